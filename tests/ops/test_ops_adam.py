"""CPUAdam and adam_step_: against torch's Adam/AdamW, across SIMD paths, with copy-out."""

from __future__ import annotations

import copy

import pytest
import torch

from zengine.ops import CPUAdam, DeepSpeedCPUAdam, adam_step_, load_op, simd_paths
from zengine.ops.adam import _torch_adam_step_

STEPS = 30
LENGTHS = (1, 7, 8, 15, 16, 17, 33, 1000003)  # tails of every vector width, and a long odd one
ALL_PATHS = ("scalar", "avx2", "avx512")


@pytest.fixture(scope="module")
def kernel():
    module = load_op("cpu_adam")
    if module is None:
        pytest.skip("the cpu_adam kernel cannot be built here (see the warning)")
    return module


def supported(path: str) -> bool:
    return path in simd_paths()


def grads(n: int, steps: int = STEPS, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for _ in range(steps)]


def movement_error(ours: torch.Tensor, ref: torch.Tensor, start: torch.Tensor) -> float:
    """Largest difference, relative to the largest distance the reference moved."""
    return float((ours - ref).abs().max() / (ref - start).abs().max())


def run_optimizer(opt_cls, start: torch.Tensor, grad_list, **kwargs) -> torch.Tensor:
    param = torch.nn.Parameter(start.clone())
    opt = opt_cls([param], **kwargs)
    for g in grad_list:
        param.grad = g.clone()
        opt.step()
    return param.detach()


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_matches_torch_adam_and_adamw(kernel, n, weight_decay, adamw_mode):
    start = torch.randn(n, generator=torch.Generator().manual_seed(0))
    grad_list = grads(n)
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    ours = run_optimizer(CPUAdam, start, grad_list, adamw_mode=adamw_mode, **kwargs)
    ref = run_optimizer(
        torch.optim.AdamW if adamw_mode else torch.optim.Adam, start, grad_list, **kwargs
    )
    # torch's own fused and default AdamW differ by ~1e-5 of the movement over 30 steps.
    assert movement_error(ours, ref, start) < 2e-5


def reference_adam_no_bias_correction(start, grad_list, lr, betas, eps, weight_decay, adamw_mode):
    """Adam without bias correction, in float64, written out plainly."""
    p = start.double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    beta1, beta2 = betas
    for g in grad_list:
        g = g.double()
        if weight_decay and not adamw_mode:
            g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        if weight_decay and adamw_mode:
            p = p * (1 - lr * weight_decay)
        p = p - lr * m / (v.sqrt() + eps)
    return p


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_without_bias_correction(kernel, adamw_mode, weight_decay):
    n = 4099
    start = torch.randn(n, generator=torch.Generator().manual_seed(3))
    grad_list = grads(n)
    kwargs = dict(lr=1e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay)
    ours = run_optimizer(
        CPUAdam, start, grad_list, adamw_mode=adamw_mode, bias_correction=False, **kwargs
    )
    ref = reference_adam_no_bias_correction(start, grad_list, adamw_mode=adamw_mode, **kwargs)
    assert movement_error(ours.double(), ref, start.double()) < 1e-4


def run_kernel(
    n,
    path,
    *,
    copy_dtype=None,
    num_threads=1,
    bias_correction=True,
    adamw_mode=True,
    wd=0.1,
    steps=STEPS,
    stepper=adam_step_,
):
    """Steps a fresh shard ``steps`` times; returns (param, exp_avg, exp_avg_sq, copy_out)."""
    gen = torch.Generator().manual_seed(5)
    param = torch.randn(n, generator=gen)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=copy_dtype) if copy_dtype is not None else None
    extra = {} if stepper is _torch_adam_step_ else dict(simd=path, num_threads=num_threads)
    for step, g in enumerate(grads(n, steps), start=1):
        hyper = dict(
            step=step,
            lr=3e-3,
            eps=1e-8,
            weight_decay=wd,
            bias_correction=bias_correction,
            adamw_mode=adamw_mode,
            copy_out=out,
        )
        if stepper is _torch_adam_step_:
            stepper(param, g, exp_avg, exp_avg_sq, beta1=0.9, beta2=0.999, **hyper)
        else:
            stepper(param, g, exp_avg, exp_avg_sq, betas=(0.9, 0.999), **hyper, **extra)
    return param, exp_avg, exp_avg_sq, out


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("n", [1, 15, 17, 1000003])
def test_every_simd_path_gives_the_scalar_bits(kernel, path, n):
    if not supported(path):
        pytest.skip(f"this CPU cannot run the {path} path")
    ref = run_kernel(n, "scalar", bias_correction=False, adamw_mode=False)
    ours = run_kernel(n, path, bias_correction=False, adamw_mode=False, num_threads=2)
    for a, b in zip(ours[:3], ref[:3]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", ALL_PATHS)
def test_environment_variable_picks_the_path(kernel, monkeypatch, path):
    monkeypatch.setenv("ZENGINE_SIMD", path)
    param, grad = torch.ones(9), torch.ones(9)
    if supported(path):
        assert kernel.simd_path() == path
        adam_step_(param, grad, torch.zeros(9), torch.zeros(9), step=1)
        assert torch.allclose(param, torch.full((9,), 1 - 1e-3))
    else:
        with pytest.raises(RuntimeError, match=path):
            adam_step_(param, grad, torch.zeros(9), torch.zeros(9), step=1)


def test_unknown_path_is_rejected(kernel, monkeypatch):
    with pytest.raises(ValueError, match="simd"):
        adam_step_(torch.ones(3), torch.ones(3), torch.zeros(3), torch.zeros(3), step=1, simd="sse")
    monkeypatch.setenv("ZENGINE_SIMD", "neon")
    with pytest.raises(RuntimeError, match="ZENGINE_SIMD"):
        adam_step_(torch.ones(3), torch.ones(3), torch.zeros(3), torch.zeros(3), step=1)


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_copy_out_equals_param_to_dtype(kernel, path, dtype):
    if not supported(path):
        pytest.skip(f"this CPU cannot run the {path} path")
    param, _, _, out = run_kernel(1000003, path, copy_dtype=dtype, steps=3, num_threads=2)
    assert torch.equal(
        out.view(torch.int16) if dtype != torch.float32 else out,
        param.to(dtype).view(torch.int16) if dtype != torch.float32 else param,
    )
    plain, _, _, _ = run_kernel(1000003, path, steps=3, num_threads=2)
    assert torch.equal(plain, param)  # the copy does not change the update


def special_values() -> torch.Tensor:
    """Values on every rounding boundary of bf16 and fp16 that a float can sit on."""
    f32 = torch.tensor(
        [
            0.0,
            -0.0,
            1.0,
            -1.0,
            65504.0,
            65519.0,
            65520.0,
            65535.0,
            1e6,
            -1e6,
            6.1035156e-05,
            6.0e-05,
            5.96e-08,
            2.98e-08,
            2.99e-08,
            1e-10,
            1e-45,
            3.4028235e38,
            -3.4028235e38,
            float("inf"),
            float("-inf"),
        ]
    )
    bits = (
        torch.tensor(
            [
                0x7FC00000,
                0xFFC00000 - (1 << 32),
                0x7F800001,
                0x7FFFFFFF,  # NaNs
                0x3F808000,
                0x3F818000,
                0x3F808001,
                0x3F80FFFF,  # bf16 ties and near-ties
                0x3F801000,
                0x3F803000,
                0x3F801001,  # fp16 ties
                0x387FE000,
                0x387FF000,
                0x33000000,
                0x33000001,
                0x337FFFFF,  # fp16 subnormals
                0x477FEFFF,
                0x477FF000,
                0x7F7FFFFF,
            ],
            dtype=torch.int64,
        )
        .to(torch.int32)
        .view(torch.float32)
    )
    gen = torch.Generator().manual_seed(9)
    spread = torch.randn(4000, generator=gen) * torch.exp(torch.randn(4000, generator=gen) * 12)
    return torch.cat([f32, bits, spread, -spread])


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conversion_rounding_matches_torch(kernel, path, dtype):
    """With lr=0 the parameters do not move, so the copy-out is exactly the conversion."""
    if not supported(path):
        pytest.skip(f"this CPU cannot run the {path} path")
    values = special_values()
    param = values.clone()
    out = torch.empty_like(param, dtype=dtype)
    adam_step_(
        param,
        torch.ones_like(param),
        torch.zeros_like(param),
        torch.zeros_like(param),
        step=1,
        lr=0.0,
        copy_out=out,
        simd=path,
    )
    finite_or_inf = ~values.isnan()  # a signalling NaN comes back quieted
    assert torch.equal(
        param[finite_or_inf].view(torch.int32), values[finite_or_inf].view(torch.int32)
    )
    # NaN bit patterns differ between torch's own scalar and vector conversions: only NaN-ness.
    assert torch.equal(
        out[finite_or_inf].view(torch.int16), values[finite_or_inf].to(dtype).view(torch.int16)
    )
    assert torch.equal(out.isnan(), values.isnan())
    scalar_out = torch.empty_like(out)
    adam_step_(
        values.clone(),
        torch.ones_like(param),
        torch.zeros_like(param),
        torch.zeros_like(param),
        step=1,
        lr=0.0,
        copy_out=scalar_out,
        simd="scalar",
    )
    assert torch.equal(out.view(torch.int16), scalar_out.view(torch.int16))  # NaNs too


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_torch_fallback_is_the_same_arithmetic(kernel, bias_correction, adamw_mode):
    kw = dict(bias_correction=bias_correction, adamw_mode=adamw_mode, copy_dtype=torch.bfloat16)
    ours = run_kernel(1003, None, **kw)
    fallback = run_kernel(1003, None, stepper=_torch_adam_step_, **kw)
    for a, b in zip(ours, fallback):
        assert torch.equal(a, b)


def test_thread_count_does_not_change_results(kernel):
    one = run_kernel(300001, None, num_threads=1, steps=3)
    two = run_kernel(300001, None, num_threads=2, steps=3)
    for a, b in zip(one[:3], two[:3]):
        assert torch.equal(a, b)


def test_step_with_copy_and_state(kernel):
    params = [torch.nn.Parameter(torch.randn(10, 3)), torch.nn.Parameter(torch.randn(5))]
    opt = DeepSpeedCPUAdam(params, lr=0.01, weight_decay=0.01)
    outs = {
        params[0]: torch.empty(10, 3, dtype=torch.bfloat16),
        params[1]: torch.empty(5, dtype=torch.float16),
    }
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step_with_copy(outs)
    for p, out in outs.items():
        assert torch.equal(out, p.detach().to(out.dtype))
        state = opt.state[p]
        assert float(state["step"]) == 3 and state["exp_avg"].shape == p.shape
    params[1].grad = None  # parameters without a gradient are skipped
    before = params[1].detach().clone()
    opt.step()
    assert torch.equal(params[1].detach(), before)


def test_state_dict_round_trips(kernel):
    """CPUAdam -> CPUAdam is exact; torch AdamW -> CPUAdam continues torch's run."""
    start = torch.randn(257)
    grad_list = grads(257, 6)
    a = torch.nn.Parameter(start.clone())
    torch_opt = torch.optim.AdamW([a], lr=1e-2, weight_decay=0.1)
    for g in grad_list[:3]:
        a.grad = g.clone()
        torch_opt.step()
    b = torch.nn.Parameter(a.detach().clone())
    ours = CPUAdam([b], lr=1.0)  # lr and weight decay come from the state dict
    ours.load_state_dict(copy.deepcopy(torch_opt.state_dict()))  # loading does not copy tensors
    assert ours.param_groups[0]["adamw_mode"] and ours.param_groups[0]["weight_decay"] == 0.1
    c = torch.nn.Parameter(a.detach().clone())
    for g in grad_list[3:5]:
        a.grad, b.grad = g.clone(), g.clone()
        torch_opt.step()
        ours.step()
    assert movement_error(b.detach(), a.detach(), start) < 2e-5

    c.data.copy_(b.detach())
    restored = CPUAdam([c])
    restored.load_state_dict(copy.deepcopy(ours.state_dict()))
    b.grad, c.grad = grad_list[5].clone(), grad_list[5].clone()
    ours.step()
    restored.step()
    assert torch.equal(b.detach(), c.detach())


def test_non_contiguous_and_per_group_options(kernel):
    base = torch.randn(6, 8)
    p_strided = torch.nn.Parameter(base.clone().t())  # not contiguous: the torch path
    p_plain = torch.nn.Parameter(torch.randn(11))
    opt = CPUAdam(
        [{"params": [p_strided]}, {"params": [p_plain], "adamw_mode": False, "lr": 0.1}], lr=0.01
    )
    ref_strided = torch.nn.Parameter(base.clone().t())
    ref_plain = torch.nn.Parameter(p_plain.detach().clone())
    ref = [
        torch.optim.AdamW([ref_strided], lr=0.01, weight_decay=0.0),
        torch.optim.Adam([ref_plain], lr=0.1),
    ]
    for _ in range(5):
        g1, g2 = torch.randn(8, 6), torch.randn(11)
        p_strided.grad, ref_strided.grad = g1.clone(), g1.clone()
        p_plain.grad, ref_plain.grad = g2.clone(), g2.clone()
        opt.step()
        for r in ref:
            r.step()
    torch.testing.assert_close(p_strided.detach(), ref_strided.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(p_plain.detach(), ref_plain.detach(), rtol=0, atol=1e-5)


def test_argument_checks():
    with pytest.raises(ValueError):
        CPUAdam([torch.nn.Parameter(torch.ones(2))], lr=-1.0)
    with pytest.raises(ValueError):
        CPUAdam([torch.nn.Parameter(torch.ones(2))], betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="elements"):
        adam_step_(torch.ones(3), torch.ones(4), torch.zeros(3), torch.zeros(3), step=1)


def test_low_precision_gradient_is_converted_once(kernel):
    grad = torch.randn(1001).to(torch.bfloat16)
    a = torch.randn(1001)
    b = a.clone()
    state_a, state_b = (
        (torch.zeros(1001), torch.zeros(1001)),
        (torch.zeros(1001), torch.zeros(1001)),
    )
    adam_step_(a, grad, *state_a, step=1, lr=0.1)
    adam_step_(b, grad.float(), *state_b, step=1, lr=0.1)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "offset", [0, 1]
)  # 0: aligned, streamed stores; 1: misaligned, plain stores
def test_large_copy_out_streamed_or_not(kernel, dtype, offset):
    n = (1 << 22) + 13  # above the kernel's streaming threshold
    gen = torch.Generator().manual_seed(2)
    param, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    reference = param.clone()
    out = torch.empty(n + offset, dtype=dtype)[offset:]
    adam_step_(param, grad, torch.zeros(n), torch.zeros(n), step=1, copy_out=out, num_threads=2)
    adam_step_(reference, grad, torch.zeros(n), torch.zeros(n), step=1, num_threads=2)
    assert torch.equal(param, reference)
    assert torch.equal(out, param.to(dtype))
