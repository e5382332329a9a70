"""bf16 matrix multiplies on the CPU (zengine/precision/cpu_matmul.py, fp32_linear.py): Fp32Linear against
an fp32 reference rounded to bf16, the policy chosen from the CPU's flags and the config, routing and
un-routing a model's linear layers, and activation checkpointing through a routed layer."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zengine.config import load_config
from zengine.precision import cpu_matmul
from zengine.precision.cpu_matmul import (
    Fp32Matmul,
    NativeMatmul,
    choose_matmul_policy,
    measure_gemm_rates,
)
from zengine.precision.fp32_linear import Fp32Linear, Fp32Scratch, fp32_linear

BF16 = torch.bfloat16


def _operands(bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 24, generator=g).to(BF16).requires_grad_()  # [batch, seq, in]
    w = (torch.randn(40, 24, generator=g) / 5).to(BF16).requires_grad_()  # [out, in]
    b = torch.randn(40, generator=g).to(BF16).requires_grad_() if bias else None
    grad = torch.randn(3, 5, 40, generator=g).to(BF16)
    return x, w, b, grad


@pytest.mark.parametrize("bias", [True, False])
def test_fp32_linear_is_the_fp32_product_rounded_to_bf16(bias):
    x, w, b, grad = _operands(bias)
    y = Fp32Linear.apply(x, w, b, Fp32Scratch())
    y.backward(grad)
    # the reference: the same bf16 values, every product in float64, each result rounded to bf16 once
    xd, wd, gd = x.detach().double(), w.detach().double(), grad.double()
    ref_y = F.linear(xd, wd, None if b is None else b.detach().double())
    ref = {"y": ref_y, "x": gd @ wd, "w": gd.reshape(-1, 40).t() @ xd.reshape(-1, 24)}
    got = {"y": y, "x": x.grad, "w": w.grad}
    if bias:
        ref["b"], got["b"] = gd.reshape(-1, 40).sum(0), b.grad
    for name, value in got.items():
        assert value.dtype is BF16, name
        # fp32 sums differ from float64 ones far below bf16's step: the rounding lands on the same bf16 value,
        # or (at a tie of the two sums around a rounding boundary) on its neighbour
        rounded = ref[name].to(BF16).double()
        step = rounded.abs().clamp_min(1e-30) * 2.0**-7
        assert ((value.double() - rounded).abs() <= step).all(), name
        assert (value.double() == rounded).float().mean() > 0.97, name
    # and as torch's own bf16 linear, within bf16 rounding of the result
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.linear(x2, w2, None if b is None else b.detach()).backward(grad)
    torch.testing.assert_close(x.grad, x2.grad, rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(w.grad, w2.grad, rtol=2**-7, atol=1e-2)


def test_fp32_linear_only_asked_gradients_and_other_dtypes_pass_through():
    x, w, b, grad = _operands()
    w.requires_grad_(False)
    b.requires_grad_(False)  # a frozen layer: only the input's gradient
    Fp32Linear.apply(x, w, b, Fp32Scratch()).backward(grad)
    assert x.grad is not None and w.grad is None and b.grad is None
    x32 = torch.randn(2, 24, requires_grad=True)
    lin = nn.Linear(24, 8)
    assert torch.equal(
        fp32_linear(x32, lin.weight, lin.bias, Fp32Scratch()), lin(x32)
    )  # fp32: F.linear itself


def test_scratch_is_reused():
    scratch = Fp32Scratch()
    first = scratch.take(torch.Size([4, 6]))
    second = scratch.take(torch.Size([2, 3]))
    assert second.data_ptr() == first.data_ptr() and scratch.nbytes() == 96


FLAGS = {
    "avx2 (issue 29)": ({"avx2", "fma", "f16c"}, None, "fp32"),
    "avx512 without bf16": ({"avx2", "avx512f", "avx512bw"}, None, "fp32"),
    "avx512_bf16 without amx (this box)": ({"avx2", "avx512f", "avx512_bf16"}, None, "native"),
    "amx": ({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, None, "native"),
    "amx, oneDNN capped at AVX2": ({"avx512_bf16", "amx_bf16"}, "AVX2", "fp32"),
    "amx, oneDNN cap at amx": ({"avx512_bf16", "amx_bf16"}, "avx512_core_amx", "native"),
    "avx512_bf16, oneDNN capped below it": ({"avx512_bf16"}, "AVX512_CORE", "fp32"),
    "flags unknown": (set(), None, "fp32"),
}


@pytest.mark.parametrize("case", FLAGS)
def test_auto_follows_the_cpu_flags(case, monkeypatch):
    flags, isa, expected = FLAGS[case]
    if isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    policy = choose_matmul_policy("auto", BF16, torch.device("cpu"), flags)
    assert policy.mode == expected and policy.reason.startswith("auto: ")
    assert (
        "\"native\"" if expected == "fp32" else "\"fp32\""
    ) in policy.reason  # the other way is named


def test_kernel_flags_are_py_cpuinfo_flags():
    import cpuinfo

    kernel = cpu_matmul._kernel_flags()
    if kernel is None:
        pytest.skip("no /proc/cpuinfo here")
    assert {"avx2", "avx512_bf16", "amx_bf16"} & kernel == {
        "avx2",
        "avx512_bf16",
        "amx_bf16",
    } & set(cpuinfo.get_cpu_info()["flags"])


def test_auto_reads_py_cpuinfo(monkeypatch):
    import cpuinfo

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(
        cpu_matmul, "_kernel_flags", lambda: None
    )  # as on a system without /proc/cpuinfo
    for flags, expected in ((["avx2", "fma"], "fp32"), (["avx512_bf16"], "native")):
        monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda flags=flags: {"flags": flags})
        cpu_matmul.cpu_flags.cache_clear()
        try:
            assert choose_matmul_policy("auto", BF16, torch.device("cpu")).mode == expected
        finally:
            cpu_matmul.cpu_flags.cache_clear()


def test_config_overrides_and_other_runs_are_untouched():
    amx, avx2 = {"amx_bf16", "avx512_bf16"}, {"avx2"}
    cpu = torch.device("cpu")
    assert choose_matmul_policy("fp32", BF16, cpu, amx).mode == "fp32"
    assert choose_matmul_policy("native", BF16, cpu, avx2).mode == "native"
    for dtype, device in (
        (torch.float32, cpu),
        (torch.float16, cpu),
        (BF16, torch.device("cuda", 0)),
        (BF16, torch.device("meta")),
    ):
        assert isinstance(choose_matmul_policy("fp32", dtype, device, avx2), NativeMatmul)
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}, 1)
    assert cfg.bf16.cpu_matmul == "auto"
    cfg = load_config(
        {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True, "cpu_matmul": "native"}}, 1
    )
    assert cfg.bf16.cpu_matmul == "native"
    with pytest.raises(Exception, match="cpu_matmul"):
        load_config(
            {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True, "cpu_matmul": "bf16"}},
            1,
        )


class _Custom(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def _net():
    torch.manual_seed(0)
    from zengine.models.gpt import LMHead

    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), _Custom(32, 32), LMHead(32, 8)).to(BF16)


def test_routing_covers_plain_linears_and_is_undone():
    model = _net()
    plain = copy.deepcopy(model)
    policy = Fp32Matmul("test")
    assert policy.apply(model) == 2  # the subclass with its own forward is left alone
    assert "forward" in vars(model[0]) and "forward" not in vars(model[2])
    assert "project" in vars(model[3]) and "forward" not in vars(
        model[3]
    )  # GPT's head: its product routed
    x = torch.randn(4, 16).to(BF16)
    torch.testing.assert_close(model(x), plain(x), rtol=2**-6, atol=1e-2)
    # routed: the head's product is fp32_linear's (fp32 products rounded once), not bf16 matmul's
    h = plain[:3](x)
    want = torch.nn.functional.linear(h.float(), model[3].weight.float(), model[3].bias.float()).to(
        BF16
    )
    torch.testing.assert_close(model[3](h), want, rtol=0, atol=0)
    copy.deepcopy(model)(x)  # a deep copy (e.g. an EMA model) still runs
    policy.remove()
    assert all("forward" not in vars(m) and "project" not in vars(m) for m in model.modules())
    assert torch.equal(model(x), plain(x))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_routed_layers_give_the_same_gradients(reentrant):
    model = _net()
    Fp32Matmul("test").apply(model)
    x = torch.randn(4, 16).to(BF16).requires_grad_()
    model(x).float().square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    checkpoint(model, x, use_reentrant=reentrant).float().square().sum().backward()
    for a, p in zip(grads, model.parameters()):
        assert torch.equal(a, p.grad)  # the recompute runs the same fp32 products


def test_measured_rates_cover_every_dtype_and_layout():
    rates = measure_gemm_rates(tokens=8, width=64, budget_s=0.001)
    assert set(rates) == {"fp32", "bf16", "bf16 via fp32"}
    for per_layout in rates.values():
        assert set(per_layout) == set(cpu_matmul.LAYOUTS) and all(
            r > 0 for r in per_layout.values()
        )
