"""adam_step_bf16_: the compiled bf16-master kernel against its torch fallback, bit for bit, on
every SIMD path, rounding mode and moment dtype; and each rounding mode against its definition."""

from __future__ import annotations

import pytest
import torch

from zengine.ops import load_op, simd_paths
from zengine.ops.adam_bf16 import (
    Rounding,
    _torch_adam_step_bf16_,
    adam_step_bf16_,
    round_stochastic,
    stochastic_bits,
)

LENGTHS = (1, 7, 8, 15, 16, 17, 33, 70001)  # tails of every vector width, and a long odd one
STEPS = 12
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8)


@pytest.fixture(scope="module")
def kernel():
    module = load_op("cpu_adam")
    if module is None or not hasattr(module, "adam_step_bf16"):
        pytest.skip("the cpu_adam kernel cannot be built here (see the warning)")
    return module


def _state(n: int, states: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen).to(torch.bfloat16)
    return dict(
        param=param,
        exp_avg=torch.zeros(n, dtype=states),
        exp_avg_sq=torch.zeros(n, dtype=states),
        compensation=torch.zeros(n, dtype=torch.bfloat16),
    )


def _run(n, states, rounding, step_fn, weight_decay=0.1, adamw_mode=True):
    s = _state(n, states)
    gen = torch.Generator().manual_seed(1)
    for t in range(1, STEPS + 1):
        grad = torch.randn(n, generator=gen).to(torch.bfloat16)
        step_fn(
            s,
            grad,
            t,
            dict(
                rounding=rounding,
                key=1000 + t,
                first_index=5,
                weight_decay=weight_decay,
                adamw_mode=adamw_mode,
            ),
        )
    return s


def _kernel_step(simd):
    def step(s, grad, t, kw):
        adam_step_bf16_(
            s["param"],
            grad,
            s["exp_avg"],
            s["exp_avg_sq"],
            compensation=s["compensation"],
            step=t,
            simd=simd,
            **HYPER,
            **kw,
        )

    return step


def _fallback_step(s, grad, t, kw):
    comp = s["compensation"] if kw["rounding"] is Rounding.KAHAN else None
    _torch_adam_step_bf16_(
        s["param"],
        grad,
        s["exp_avg"],
        s["exp_avg_sq"],
        comp,
        lr=HYPER["lr"],
        beta1=HYPER["betas"][0],
        beta2=HYPER["betas"][1],
        eps=HYPER["eps"],
        step=t,
        bias_correction=True,
        **kw,
    )


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("rounding", list(Rounding))
@pytest.mark.parametrize("states", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
def test_kernel_matches_fallback_bitwise(kernel, n, rounding, states, path):
    if path not in simd_paths():
        pytest.skip(f"this CPU has no {path}")
    ours = _run(n, states, rounding, _kernel_step(path))
    ref = _run(n, states, rounding, _fallback_step)
    for name in ("param", "exp_avg", "exp_avg_sq", "compensation"):
        assert torch.equal(ours[name].view(-1), ref[name].view(-1)), name
    assert not torch.equal(ours["param"], _state(n, states)["param"]) or n == 0


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_l2_mode_two_threads_matches_fallback(kernel, adamw_mode):
    one = _run(200003, torch.bfloat16, Rounding.STOCHASTIC, _kernel_step(None), 0.1, adamw_mode)
    torch.set_num_threads(1)
    try:
        again = _run(200003, torch.bfloat16, Rounding.STOCHASTIC, _fallback_step, 0.1, adamw_mode)
    finally:
        torch.set_num_threads(2)
    assert torch.equal(one["param"], again["param"])


def test_nearest_is_the_fp32_update_rounded_once():
    """Nearest: the master is the fp32 AdamW update of the widened master, rounded once."""
    s = _state(1000, torch.bfloat16)
    start = s["param"].float()
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    adam_step_bf16_(s["param"], grad, s["exp_avg"], s["exp_avg_sq"], step=1, lr=1e-2)
    # step 1 with zero moments: m = 0.1 g, v = 0.001 g^2, bias-corrected update = lr * g/(|g|+eps)
    g = grad.float()
    expected = start - 1e-2 * g / (g.abs() + 1e-8)
    assert torch.equal(s["param"], expected.to(torch.bfloat16))
    assert s["exp_avg"].dtype == torch.bfloat16


def test_kahan_keeps_updates_below_half_an_ulp():
    """A constant update of a quarter ulp: nearest never moves the weight, Kahan moves it by the
    sum of the updates (to within one bf16 ulp of the compensation)."""
    n, steps = 64, 40
    param0 = torch.ones(n, dtype=torch.bfloat16)  # ulp of 1.0 in bf16: 2^-7
    for rounding in (Rounding.NEAREST, Rounding.KAHAN):
        s = dict(param=param0.clone(), m=torch.zeros(n), v=torch.zeros(n))
        comp = torch.zeros(n, dtype=torch.bfloat16)
        for t in range(1, steps + 1):
            # an Adam update of exactly lr for a gradient of constant sign (bias corrected)
            adam_step_bf16_(
                s["param"],
                -torch.ones(n, dtype=torch.bfloat16),
                s["m"],
                s["v"],
                step=t,
                lr=2.0**-9,
                eps=0.0,
                compensation=comp,
                rounding=rounding,
            )
        total = float((s["param"].float() + comp.float()).mean()) - 1.0
        if rounding is Rounding.NEAREST:
            assert torch.equal(s["param"], param0)  # every quarter-ulp step is lost
        else:
            assert abs(total - steps * 2.0**-9) < 2.0**-16
            assert float(s["param"].float().mean()) > 1.0


def test_stochastic_rounding_matches_its_definition_and_is_unbiased():
    x = torch.full((200000,), 1.0 + 2.0**-9)  # a quarter of the way from 1 to the next bf16
    bits = stochastic_bits(x.numel(), key=7, first_index=0)
    rounded = round_stochastic(x, bits)
    up = rounded.float() > 1.0
    # up exactly where the 16 random bits reach the dropped part (0x4000 of 0x10000)
    assert torch.equal(up, bits >= 0x10000 - 0x4000)
    assert abs(float(up.float().mean()) - 0.25) < 0.01
    specials = torch.tensor([float("inf"), float("-inf"), float("nan")])
    out = round_stochastic(specials, torch.full((3,), 0xFFFF))
    assert out[0] == float("inf") and out[1] == float("-inf") and torch.isnan(out[2])


def test_refusals():
    p = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="compensation"):
        adam_step_bf16_(p, p, p.clone(), p.clone(), step=1, rounding=Rounding.KAHAN)
    with pytest.raises(ValueError, match="must be bf16"):
        adam_step_bf16_(p.float(), p, p.clone(), p.clone(), step=1)


@pytest.mark.parametrize("rounding", list(Rounding))
@pytest.mark.parametrize("fp32_states", [True, False])
def test_cpu_adam_steps_bf16_parameters_as_the_step_function(rounding, fp32_states):
    """CPUAdam over a bf16 parameter: moments in bf16 (or fp32 with fp32_optimizer_states), a
    compensation only with Kahan; step_runs over two pieces gives the bits of one whole step."""
    from zengine.ops import CPUAdam

    start = torch.randn(1001, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    gens = [torch.Generator().manual_seed(9) for _ in range(2)]
    params = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    opts = [
        CPUAdam(
            [p], lr=1e-2, weight_decay=0.1, fp32_optimizer_states=fp32_states, rounding=rounding
        )
        for p in params
    ]
    for t in range(1, 6):
        for p, gen in zip(params, gens):
            p.grad = torch.randn(1001, generator=gen).to(torch.bfloat16)
        opts[0].step()
        opts[1].step_runs({params[1]: [(0, 500, t), (500, 1001, t)]}, {})
    state = opts[0].state[params[0]]
    want = torch.float32 if fp32_states else torch.bfloat16
    assert state["exp_avg"].dtype == want and state["exp_avg_sq"].dtype == want
    assert ("compensation" in state) == (rounding is Rounding.KAHAN)
    assert torch.equal(params[0], params[1]) and not torch.equal(params[0], start)


def _lowbias32(x: int) -> int:
    """Wellons' lowbias32 on a Python int: the definition the kernel's hash follows."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _reference_step(p, c, m, v, g, t, rounding, key, lr=1e-2, b1=0.9, b2=0.99, eps=1e-8, wd=0.1):
    """One AdamW step of a bf16 master written from the modes' definitions, element by element
    in numpy-free Python floats rounded to fp32 after each operation (torch scalars)."""
    import math

    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731 - one rounding to fp32
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    out_p, out_c, out_m, out_v = [], [], [], []
    for i in range(p.numel()):
        x = f32(float(p[i])) + (f32(float(c[i])) if rounding is Rounding.KAHAN else 0)
        gi = f32(float(g[i]))
        mi = f32(float(m[i])) + f32(1 - b1) * (gi - f32(float(m[i])))
        vi = f32(b2) * f32(float(v[i])) + f32(1 - b2) * (gi * gi)
        d = f32(math.sqrt(float(vi))) * f32(1 / math.sqrt(bc2)) + f32(eps)
        x = x * f32(1 - lr * wd)
        x = x + f32(-lr / bc1) * (mi / d)
        if rounding is Rounding.STOCHASTIC:
            bits = int(x.view(torch.int32)) & 0xFFFFFFFF
            bits = (bits + (_lowbias32(key ^ i) & 0xFFFF)) >> 16
            kept = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        else:
            kept = x.to(torch.bfloat16)
        out_p.append(kept)
        out_c.append((x - kept.float()).to(torch.bfloat16))
        out_m.append(mi.to(torch.bfloat16))
        out_v.append(vi.to(torch.bfloat16))
    return [torch.stack(t) for t in (out_p, out_c, out_m, out_v)]


@pytest.mark.parametrize("rounding", list(Rounding))
def test_each_rounding_is_exact_against_its_definition(rounding):
    """Five steps of adam_step_bf16_ (the kernel where built, else the fallback) against the
    element-by-element reference written from the mode's definition: every bit equal."""
    n = 67
    gen = torch.Generator().manual_seed(4)
    p = torch.randn(n, generator=gen).to(torch.bfloat16)
    ref = [p.clone(), torch.zeros(n, dtype=torch.bfloat16)] + [
        torch.zeros(n, dtype=torch.bfloat16) for _ in range(2)
    ]
    ours = [t.clone() for t in ref]
    for t in range(1, 6):
        g = (torch.randn(n, generator=gen) * 10.0 ** (-t)).to(torch.bfloat16)
        adam_step_bf16_(
            ours[0],
            g,
            ours[2],
            ours[3],
            compensation=ours[1],
            step=t,
            rounding=rounding,
            key=77 + t,
            lr=1e-2,
            betas=(0.9, 0.99),
            eps=1e-8,
            weight_decay=0.1,
        )
        p_new, c_new, m_new, v_new = _reference_step(*ref[:2], *ref[2:], g, t, rounding, 77 + t)
        ref = [p_new, c_new if rounding is Rounding.KAHAN else ref[1], m_new, v_new]
    for name, a, b in zip(("param", "compensation", "exp_avg", "exp_avg_sq"), ours, ref):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_fp16_master_is_fp32_adam_rounded_once(adamw_mode):
    """An fp16 master (fp16_master_weights_and_grads) steps with fp32 moments: after each step the
    moments are torch's fp32 AdamW/Adam ones on the fp16 values, the master its result rounded to
    nearest fp16 (within one fp16 ulp: torch orders the operations otherwise)."""
    g = torch.Generator().manual_seed(3)
    n = 4099
    param = (torch.randn(n, generator=g) * 0.1).half()
    m, v = torch.zeros(n), torch.zeros(n)
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    for step in range(1, 4):
        grad = (torch.randn(n, generator=g) * 1e-2).half()
        ref = param.float().clone().requires_grad_(True)
        ref.grad = grad.float()
        cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
        opt = cls([ref], **hyper)
        opt.state[ref] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.clone()}
        opt.state[ref]["exp_avg_sq"] = v.clone()
        opt.step()
        adam_step_bf16_(param, grad, m, v, step=step, adamw_mode=adamw_mode, **hyper)
        assert param.dtype == torch.float16 and m.dtype == torch.float32
        torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(v, opt.state[ref]["exp_avg_sq"], rtol=1e-6, atol=1e-12)
        ulp = torch.finfo(torch.float16).eps * ref.detach().abs().clamp_min(2.0**-14)
        assert ((param.float() - ref.detach()).abs() <= ulp).all()
        moved = (param.float() - ref.detach().half().float()).abs().max()
        assert moved <= ulp.max(), moved  # (nearest: at most one ulp from torch's rounding)


def test_fp16_master_refuses_fp16_moments_and_other_roundings():
    p, gr = torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.float16)
    with pytest.raises(ValueError, match="fp32 moments and rounds to nearest"):
        adam_step_bf16_(p, gr, torch.zeros_like(p), torch.zeros_like(p), step=1)
    m = torch.zeros(4)
    with pytest.raises(ValueError, match="fp32 moments and rounds to nearest"):
        adam_step_bf16_(p, gr, m, m.clone(), step=1, rounding=Rounding.STOCHASTIC)


def _fp16_run(n, step_fn, adamw_mode):
    """STEPS over an fp16 master (fp32 moments) whose values span normals, subnormals and a zero,
    with fp16 gradients: the kernel's F16C loads/stores against torch's conversions."""
    gen = torch.Generator().manual_seed(2)
    scales = torch.tensor([1.0, 1e-3, 1e-6, 0.0]).repeat(n // 4 + 1)[:n]
    s = dict(
        param=(torch.randn(n, generator=gen) * scales).half(),
        exp_avg=torch.zeros(n),
        exp_avg_sq=torch.zeros(n),
        compensation=None,
    )
    for t in range(1, STEPS + 1):
        grad = (torch.randn(n, generator=gen) * scales.flip(0)).half()
        kw = dict(rounding=Rounding.NEAREST, key=0, first_index=0, adamw_mode=adamw_mode)
        step_fn(s, grad, t, dict(kw, weight_decay=0.1))
    return s


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
def test_fp16_kernel_matches_fallback_bitwise(kernel, n, adamw_mode, path):
    if path not in simd_paths():
        pytest.skip(f"this CPU has no {path}")
    if not hasattr(kernel, "adam_step_fp16"):
        pytest.fail("the cpu_adam kernel lacks adam_step_fp16")
    ours = _fp16_run(n, _kernel_step(path), adamw_mode)
    ref = _fp16_run(n, _fallback_step, adamw_mode)
    for name in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(ours[name].view(-1), ref[name].view(-1)), name
    assert ours["param"].dtype == torch.float16
    assert not torch.equal(ours["param"], _fp16_run(n, lambda *a: None, adamw_mode)["param"])
