"""What Hugging Face's transformers and accelerate ask of DeepSpeed, asked of zengine the way they ask it
(issue 25 items 1-2): the ``deepspeed`` distribution under the compatibility mode (zengine/compat.py), and
the members their Trainer and ``DeepSpeedPlugin`` call (``scale_wrt_gas=False``, ``load_module_strict``,
``engine.config`` as a dict, the 16-bit state dict with tied weights, ``zero.Init`` with "auto" values,
``steps_per_print`` set to infinity, ``GatheredParameters`` with ``fwd_module``)."""

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zengine
from zengine.compat import DEEPSPEED_VERSION
from configs import ds_config
from harness import spawn

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(zengine.__file__)))


def _env(extra_path: str = None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [extra_path, PACKAGE_ROOT, env.get("PYTHONPATH")] if p
    )
    return env


def _python(code: str, extra_path: str = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env=_env(extra_path),
        capture_output=True,
        text=True,
        timeout=180,
    )


# -- item 1: the distribution questions, inside the compatibility mode and not outside it ---------------
_ASK = (
    "import importlib.metadata as md, importlib.util as iu\n"
    "try:\n    print('version', md.version('deepspeed'), md.metadata('deepspeed')['Name'])\n"
    "except md.PackageNotFoundError:\n    print('version none')\n"
    "print('spec', iu.find_spec('deepspeed') is not None)\n"
)


def test_distribution_answers_inside_compat_only(tmp_path):
    outside = _python(_ASK)
    assert outside.returncode == 0, outside.stderr
    assert outside.stdout.split() == ["version", "none", "spec", "False"]
    inside = _python("import zengine.compat as c; c.install()\n" + _ASK)
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout.split() == ["version", DEEPSPEED_VERSION, "deepspeed", "spec", "True"]
    script = tmp_path / "ask.py"
    script.write_text(_ASK)
    wrapped = subprocess.run(
        [sys.executable, "-m", "zengine.compat", str(script)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert wrapped.returncode == 0, wrapped.stderr
    assert wrapped.stdout.split()[:3] == ["version", DEEPSPEED_VERSION, "deepspeed"]


def test_transformers_sees_deepspeed_and_its_members_under_compat():
    pytest.importorskip("transformers")
    code = (
        "import zengine, zengine.compat as c; c.install()\n"
        "from transformers.integrations.deepspeed import is_deepspeed_available, prevent_arange_dtype_change\n"
        "import transformers.utils.import_utils as iu\n"
        "from packaging import version; import importlib.metadata as md\n"
        "assert is_deepspeed_available()\n"
        "assert version.parse(md.version('deepspeed')) >= version.parse('0.9.3')\n"
        "from deepspeed import DeepSpeedEngine; assert DeepSpeedEngine is zengine.Engine\n"
        "from deepspeed.runtime.engine import DeepSpeedEngine as E2; assert E2 is zengine.Engine\n"
        "from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES; assert 'WarmupLR' in VALID_LR_SCHEDULES\n"
        "from deepspeed.checkpoint.utils import clone_tensors_for_torch_save\n"
        "from deepspeed.runtime.zero import partition_parameters as pp\n"
        "import torch\n"
        "before = pp.zero_wrapper_for_fp_tensor_constructor\n"
        "with prevent_arange_dtype_change():\n"
        "    hook = pp.zero_wrapper_for_fp_tensor_constructor\n"
        "    assert hook is not before\n"
        "    r = hook(pp._orig_torch_arange, torch.bfloat16, target_device=torch.device('cpu'))(4, dtype=torch.int64)\n"
        "    assert r.dtype == torch.int64 and r.tolist() == [0, 1, 2, 3]\n"
        "assert pp.zero_wrapper_for_fp_tensor_constructor is before\n"
        "t = before(torch.zeros, torch.bfloat16, target_device=torch.device('cpu'))(2)\n"
        "assert t.dtype == torch.float32\n"
        "print('ok')\n"
    )
    out = _python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok"]


def test_accelerate_sees_deepspeed_under_compat():
    pytest.importorskip("accelerate")
    code = (
        "import zengine.compat as c; c.install()\n"
        "from accelerate.utils import is_deepspeed_available, compare_versions\n"
        "assert is_deepspeed_available() and compare_versions('deepspeed', '>=', '0.9.3')\n"
        "from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME\n"  # accelerate launch --use_deepspeed
        "from accelerate.utils.deepspeed import DeepSpeedEngineWrapper\n"
        "print('ok')\n"
    )
    out = _python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok"]


def test_compat_refuses_beside_a_real_deepspeed(tmp_path):
    (
        tmp_path / "deepspeed"
    ).mkdir()  # a plain folder of that name (say, of configs) is no DeepSpeed
    out = _python("import zengine.compat as c; c.install()\n" + _ASK, extra_path=str(tmp_path))
    assert out.returncode == 0 and out.stdout.split()[1] == DEEPSPEED_VERSION, out.stderr
    (tmp_path / "deepspeed" / "__init__.py").write_text("__version__ = '0.19.8'\n")
    out = _python(
        "import zengine.compat as c\ntry:\n    c.install()\nexcept c.RealDeepSpeedError as e:\n"
        "    print('refused', e)\nimport deepspeed; print(deepspeed.__file__)",
        extra_path=str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused zengine.compat: a real DeepSpeed is importable"), (
        out.stdout
    )
    assert str(tmp_path / "deepspeed") in out.stdout.splitlines()[0]
    assert out.stdout.splitlines()[-1] == str(tmp_path / "deepspeed" / "__init__.py")  # untouched


def test_clone_tensors_for_torch_save_owns_its_elements():
    from zengine.checkpoint.utils import clone_tensors_for_torch_save

    flat = torch.arange(10.0, requires_grad=True)
    state = {"a": flat[:3], "b": [flat[3:5], (flat[5:],)], "n": 7}
    out = clone_tensors_for_torch_save(state)
    assert out["n"] == 7 and out["a"].untyped_storage().nbytes() == 3 * 4
    assert not out["a"].requires_grad and out["b"][1][0].tolist() == flat[5:].tolist()


def test_steps_per_print_infinite_and_config_read_as_a_dict():
    from zengine.config import load_config

    cfg = load_config(
        {"train_batch_size": 4, "steps_per_print": float("inf"), "zero_optimization": {"stage": 2}},
        1,
    )
    assert cfg.steps_per_print > 2**62  # never comes round
    assert cfg.get("zero_optimization", {}).get("stage") == 2
    assert cfg["train_batch_size"] == 4 and cfg.get("no_such_key", "dflt") == "dflt"


# -- item 2: the engine members, called as the Trainer and accelerate call them, on 2 ranks ---------------
VOCAB, DIM, GAS, MICRO = 13, 8, 2, 2


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied, as a causal LM's

    def forward(self, x, y):
        return F.cross_entropy(
            self.head(torch.tanh(self.fc(self.emb(x)))).view(-1, VOCAB), y.view(-1)
        )


def _hf_config(stage: int) -> dict:
    """A config as transformers hands it over: "auto" left in the optimizer and scheduler sections when it
    enters zero.Init, filled in before initialize; accelerate's infinite steps_per_print."""
    auto = {"type": "AdamW", "params": dict.fromkeys(("lr", "betas", "weight_decay"), "auto")}
    return ds_config(
        stage,
        micro_batch="auto",
        gas="auto",
        optimizer=auto,
        steps_per_print=float("inf"),
        train_batch_size="auto",
        zero={"stage3_gather_16bit_weights_on_model_save": True},
        bf16={"enabled": "auto"},
        scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
    )


def _filled(cfg: dict) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg.update(
        train_micro_batch_size_per_gpu=MICRO,
        gradient_accumulation_steps=GAS,
        train_batch_size=MICRO * GAS * dist.get_world_size(),
        bf16={"enabled": False},
    )
    cfg["optimizer"] = {
        "type": "SGD",
        "params": {"lr": 0.5},
    }  # not scale-invariant as Adam: a double division shows
    del cfg["scheduler"]
    return cfg


def _batches(steps: int):
    g = torch.Generator().manual_seed(5)
    world = dist.get_world_size()
    return [
        (x, (x * 3 + 1) % VOCAB)
        for x in (
            torch.randint(0, VOCAB, (MICRO * GAS * world, 4), generator=g) for _ in range(steps)
        )
    ]


def _hf_run(stage: int, ckpt: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _Tied()
    with zengine.zero.Init(
        config_dict_or_path=_hf_config(stage), enabled=stage == 3
    ):  # "auto" sections too
        torch.manual_seed(0)
        model = _Tied()
    engine, *_ = zengine.initialize(
        model=model, model_parameters=model.parameters(), config=_filled(_hf_config(stage))
    )
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    batches = _batches(3)
    for (
        x,
        y,
    ) in batches:  # the Trainer's step: each micro loss divided by gas, then scale_wrt_gas=False
        for m in range(GAS):
            rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
            engine.backward(engine(x[rows], y[rows]) / GAS, scale_wrt_gas=False)
            engine.step()
        ref_opt.zero_grad()
        reference(x, y).backward()
        ref_opt.step()
    out = {
        "stage": engine.config.get("zero_optimization", {}).get("stage"),
        "gather_on_save": engine.zero_gather_16bit_weights_on_model_save(),
        "is_engine": isinstance(engine, zengine.DeepSpeedEngine),
    }
    state = engine._zero3_consolidated_16bit_state_dict()
    if rank == 0:
        out["tied_shared"] = state["head.weight"] is state["emb.weight"]
        out["diff"] = max(
            (state[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()
        )
        out["keys"] = sorted(state)
    else:
        out["none_elsewhere"] = state is None
    engine.save_checkpoint(ckpt)
    path, _ = engine.load_checkpoint(
        ckpt, load_module_strict=False, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    out["loaded"] = path is not None
    weight = engine.module.fc.weight
    with zengine.zero.GatheredParameters(
        [weight], modifier_rank=0, fwd_module=engine.module, enabled=True
    ):
        out["gathered_shape"] = list(weight.shape)
    x, y = batches[0]  # one window mixing both kinds of pass: refused, by name, at the step
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    engine.backward(engine(x[rows], y[rows]))
    engine.step()
    engine.backward(engine(x[rows], y[rows]) / GAS, scale_wrt_gas=False)
    try:
        engine.step()
    except RuntimeError as e:
        out["mixed"] = "scale_wrt_gas=False" in str(e)
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_style_step_and_members_match_torch(stage, tmp_path):
    for rank, out in enumerate(spawn(_hf_run, 2, stage, str(tmp_path / "ckpt"))):
        assert (
            out["stage"] == stage and out["gather_on_save"] and out["is_engine"] and out["loaded"]
        )
        assert out["gathered_shape"] == [DIM, DIM] and out.get("mixed"), out
        if rank == 0:
            assert out["tied_shared"] and out["keys"] == [
                "emb.weight",
                "fc.bias",
                "fc.weight",
                "head.weight",
            ]
            assert out["diff"] < 1e-5, (
                out
            )  # gas 2, divided once (by the Trainer), as torch on the global batch
        else:
            assert out["none_elsewhere"]


def test_torchrun_with_zengine_compat_as_target(tmp_path):
    """The opt-in for launchers that start the processes themselves: ``-m zengine.compat`` as the target."""
    from harness import free_port

    script = tmp_path / "ask.py"
    script.write_text(_ASK)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "-m",
            "zengine.compat",
            str(script),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split().count(DEEPSPEED_VERSION) == 2, run.stdout


# -- GatheredParameters inside the forward, around a tied head (TRL's fused loss does this) ----------------
class _FusedHead(_Tied):
    """The loss reads the head's weight directly, gathered for the call, as TRL's SFTTrainer does under ZeRO-3:
    the head module never runs, and its weight is the embedding's (released after the embedding ran)."""

    def forward(self, x, y):
        h = torch.tanh(self.fc(self.emb(x)))
        with zengine.zero.GatheredParameters([self.head.weight]):
            logits = F.linear(h, self.head.weight)
        return F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))


def _fused_head_run():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _FusedHead()
    torch.manual_seed(0)
    model = _FusedHead()
    cfg = _filled(_hf_config(3))
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = zengine.initialize(model=model, config=cfg)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for x, y in _batches(3):
        for m in range(GAS):
            rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
            engine.backward(engine(x[rows], y[rows]))
            engine.step()
        ref_opt.zero_grad()
        reference(x, y).backward()
        ref_opt.step()
    state = engine._zero3_consolidated_16bit_state_dict()
    if rank == 0:
        return max(
            (state[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()
        )


def test_gathered_parameters_inside_forward_on_a_tied_head():
    """It used to fail at the first step: the gather's own parameter swaps were taken for a user's reads."""
    diff = spawn(_fused_head_run, 2)[0]
    assert diff < 1e-5, diff
