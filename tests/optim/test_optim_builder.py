"""build_optimizer: DeepSpeed's meanings for the config's ``optimizer`` section."""

import pytest
import torch

from zengine.optim import build_optimizer
from zengine.optim import builder


def make_params(seed=0, count=2):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=generator)) for _ in range(count)]


def set_grads(params, seed=1):
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)


def steps_agree(ours_factory, reference_factory, steps=3):
    """Run both optimizers over identical parameters and gradients; return the parameters."""
    ours_params, ref_params = make_params(), make_params()
    ours, reference = ours_factory(ours_params), reference_factory(ref_params)
    for step in range(steps):
        set_grads(ours_params, seed=step)
        set_grads(ref_params, seed=step)
        ours.step()
        reference.step()
    return ours_params, ref_params


@pytest.fixture
def no_kernel(monkeypatch):
    """As if zengine.ops (the compiled CPUAdam) were not installed."""
    monkeypatch.setattr(builder, "_compiled_cpu_adam", lambda: None)


# --- Adam and AdamW -------------------------------------------------------------------------


def test_adam_defaults_to_decoupled_weight_decay():
    opt = build_optimizer(
        "Adam",
        {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1},
        [{"params": make_params()}],
    )
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        0.01,
        (0.8, 0.99),
        1e-6,
        0.1,
    )


def test_adam_default_mode_steps_like_torch_adamw():
    hyper = dict(lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.3)
    ours, ref = steps_agree(
        lambda ps: build_optimizer(
            "Adam", {**hyper, "betas": list(hyper["betas"])}, [{"params": ps}]
        ),
        lambda ps: torch.optim.AdamW(ps, **hyper, foreach=False),
    )
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)


def test_adam_w_mode_false_steps_like_torch_adam():
    hyper = dict(lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.3)
    opt = build_optimizer("adam", {**hyper, "adam_w_mode": False}, make_params())
    assert type(opt) is torch.optim.Adam
    ours, ref = steps_agree(
        lambda ps: build_optimizer("adam", {**hyper, "adam_w_mode": False}, [{"params": ps}]),
        lambda ps: torch.optim.Adam(ps, **hyper, foreach=False),
    )
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)
    # L2 Adam and decoupled decay really differ at this weight decay.
    decoupled, _ = steps_agree(
        lambda ps: build_optimizer("adam", hyper, ps), lambda ps: torch.optim.Adam(ps, **hyper)
    )
    assert not torch.allclose(decoupled[0], ours[0])


def test_adamw_is_decoupled_even_with_adam_w_mode_false():
    assert (
        type(build_optimizer("AdamW", {"adam_w_mode": False}, make_params())) is torch.optim.AdamW
    )


def test_weight_decay_defaults_to_zero_like_deepspeed_kernels():
    assert build_optimizer("AdamW", {}, make_params()).defaults["weight_decay"] == 0.0
    assert build_optimizer("Adam", {}, make_params()).defaults["weight_decay"] == 0.0


def test_fused_on_cpu_by_default_and_switches_off():
    assert build_optimizer("Adam", {}, make_params()).defaults["fused"] is True
    assert build_optimizer("AdamW", {"adam_w_mode": True}, make_params()).defaults["fused"] is True
    assert not build_optimizer("Adam", {"fused": False}, make_params()).defaults["fused"]
    assert not build_optimizer("Adam", {"foreach": True}, make_params()).defaults["fused"]


def test_not_fused_for_parameters_off_cpu_and_cuda():
    meta = [torch.nn.Parameter(torch.empty(4, device="meta"))]
    assert not build_optimizer("Adam", {}, meta).defaults["fused"]


def test_torch_adam_selects_torch_class_with_torch_defaults():
    opt = build_optimizer("Adam", {"torch_adam": True}, make_params())
    assert type(opt) is torch.optim.AdamW
    assert not opt.defaults["fused"]
    assert (
        opt.defaults["weight_decay"] == 0.01
    )  # torch's AdamW default, as DeepSpeed passes through
    opt = build_optimizer("Adam", {"torch_adam": True, "adam_w_mode": False}, make_params())
    assert type(opt) is torch.optim.Adam


def test_bias_correction(no_kernel):
    assert (
        type(build_optimizer("Adam", {"bias_correction": True}, make_params())) is torch.optim.AdamW
    )
    with pytest.raises(ValueError, match=r"optimizer\.params\.bias_correction"):
        build_optimizer("Adam", {"bias_correction": False}, make_params())


def test_amsgrad_and_case_insensitive_names():
    opt = build_optimizer("ADAMW", {"amsgrad": True}, make_params())
    assert type(opt) is torch.optim.AdamW and opt.defaults["amsgrad"] is True


# --- CPUAdam --------------------------------------------------------------------------------


def test_cpu_adam_without_kernel_is_torch_adamw(no_kernel):
    for name in ("CPUAdam", "DeepSpeedCPUAdam", "cpuadam"):
        opt = build_optimizer(name, {"lr": 0.02, "weight_decay": 0.1}, make_params())
        assert type(opt) is torch.optim.AdamW
        assert (opt.defaults["lr"], opt.defaults["weight_decay"]) == (0.02, 0.1)
    assert (
        type(build_optimizer("CPUAdam", {"adamw_mode": False}, make_params())) is torch.optim.Adam
    )


class FakeKernel(torch.optim.Optimizer):
    """Stands in for zengine.ops.CPUAdam; records its arguments."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        adamw_mode=True,
        bias_correction=True,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
                adamw_mode=adamw_mode,
                bias_correction=bias_correction,
            ),
        )


def test_cpu_adam_uses_the_kernel_when_present(monkeypatch):
    monkeypatch.setattr(builder, "_compiled_cpu_adam", lambda: FakeKernel)
    opt = build_optimizer(
        "DeepSpeedCPUAdam",
        {"lr": 0.02, "bias_correction": False, "adam_w_mode": False},
        make_params(),
    )
    assert type(opt) is FakeKernel
    assert (opt.defaults["lr"], opt.defaults["adamw_mode"], opt.defaults["bias_correction"]) == (
        0.02,
        False,
        False,
    )
    # Adam with bias_correction false, or Adam over offloaded CPU shards, goes to the kernel too.
    assert type(build_optimizer("Adam", {"bias_correction": False}, make_params())) is FakeKernel
    assert type(build_optimizer("Adam", {}, make_params(), cpu_offload=True)) is FakeKernel
    assert type(build_optimizer("Adam", {}, make_params())) is torch.optim.AdamW
    with pytest.raises(ValueError, match=r"optimizer\.params\.amsgrad"):
        build_optimizer("CPUAdam", {"amsgrad": True}, make_params())


# --- torch.optim by name --------------------------------------------------------------------


def test_sgd_hyper_parameters():
    opt = build_optimizer(
        "SGD",
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 1e-4, "nesterov": True},
        make_params(),
    )
    assert type(opt) is torch.optim.SGD
    group = opt.param_groups[0]
    assert (
        group["lr"],
        group["momentum"],
        group["dampening"],
        group["weight_decay"],
        group["nesterov"],
    ) == (0.1, 0.9, 0.0, 1e-4, True)


def test_adagrad_and_rmsprop():
    opt = build_optimizer("adagrad", {"lr": 0.2, "lr_decay": 0.01, "eps": 1e-9}, make_params())
    assert type(opt) is torch.optim.Adagrad
    assert (opt.defaults["lr"], opt.defaults["lr_decay"], opt.defaults["eps"]) == (0.2, 0.01, 1e-9)
    opt = build_optimizer(
        "RMSprop", {"lr": 0.02, "alpha": 0.9, "momentum": 0.5, "centered": True}, make_params()
    )
    assert type(opt) is torch.optim.RMSprop
    assert (opt.defaults["alpha"], opt.defaults["momentum"], opt.defaults["centered"]) == (
        0.9,
        0.5,
        True,
    )


# --- param groups ---------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", ["Adam", "AdamW", "SGD", "CPUAdam"])
def test_per_group_hyper_parameters_are_kept(type_name, no_kernel):
    first, second = make_params()
    given = [
        {"params": [first], "lr": 0.5, "weight_decay": 0.25, "name": "decay"},
        {"params": iter([second])},
    ]
    opt = build_optimizer(type_name, {"lr": 0.01, "weight_decay": 0.0}, given)
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["weight_decay"] == 0.25
    assert opt.param_groups[0]["name"] == "decay"
    assert opt.param_groups[1]["lr"] == 0.01 and opt.param_groups[1]["weight_decay"] == 0.0
    assert opt.param_groups[1]["params"] == [second]
    assert set(given[0]) == {"params", "lr", "weight_decay", "name"}  # the caller's dicts untouched


def test_group_betas_list_becomes_tuple():
    opt = build_optimizer("Adam", {}, [{"params": make_params(), "betas": [0.5, 0.9]}])
    assert opt.param_groups[0]["betas"] == (0.5, 0.9)


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "type_name,params,expected",
    [
        ("Adam", {"lrr": 0.1}, r"optimizer\.params\.lrr .*did you mean 'lr'"),
        ("Adam", {"beta": [0.9, 0.99]}, r"optimizer\.params\.beta .*did you mean 'betas'"),
        ("SGD", {"momentun": 0.9}, r"optimizer\.params\.momentun .*did you mean 'momentum'"),
        (
            "SGD",
            {"betas": [0.9, 0.99]},
            r"optimizer\.params\.betas is not a parameter of the SGD optimizer",
        ),
        ("Adam", {"lr": "1e-3"}, r"optimizer\.params\.lr must be a number"),
        ("Adam", {"lr": -0.1}, r"optimizer\.params\.lr must be >= 0"),
        ("Adam", {"betas": [0.9]}, r"optimizer\.params\.betas must be a list of 2 numbers"),
        ("Adam", {"betas": [0.9, 1.5]}, r"optimizer\.params\.betas must lie in \[0, 1\)"),
        ("Adam", {"adam_w_mode": "yes"}, r"optimizer\.params\.adam_w_mode must be true or false"),
        ("Adam", {"max_grad_norm": 1.0}, r"optimizer\.params\.max_grad_norm .*gradient_clipping"),
        ("Adam", {"adam_w_mode": True, "adamw_mode": False}, r"optimizer\.params\.adam_w_mode"),
        ("Adamm", {}, r"optimizer\.type 'Adamm' .*did you mean 'Adam'"),
        ("Lamb", {}, r"optimizer\.type 'Lamb'.*DeepSpeed's Lamb"),
        ("NoSuchThing", {}, r"optimizer\.type 'NoSuchThing'"),
    ],
)
def test_errors_name_the_key(type_name, params, expected):
    with pytest.raises(ValueError, match=expected):
        build_optimizer(type_name, params, make_params())


def test_a_plain_list_of_tensors_is_one_group():
    params = make_params()
    opt = build_optimizer("SGD", {"lr": 0.1}, params)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"] == params
