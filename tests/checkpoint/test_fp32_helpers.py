"""DeepSpeed's fp32 helpers and the scripts beside checkpoints, on zengine's checkpoints and on DeepSpeed's.

``deepspeed.utils.zero_to_fp32``'s get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint,
convert_zero_checkpoint_to_fp32_state_dict (and convert_zero_checkpoint_to_state_dict), and Lightning's converter:
on every DeepSpeed 0.19.8 fixture they give what DeepSpeed's own zero_to_fp32 gave there (recorded by
tests/fixtures/deepspeed/make_fp32.py in zero_to_fp32_0.19.8.pt), and on zengine checkpoints the engine's own
full fp32 masters. The zero_to_fp32.py and zero_to_torch.py scripts save_checkpoint writes (as DeepSpeed 0.19.8
writes both) run with plain ``python``, no compat variable, on both kinds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import zengine
from checkpoint_runs import BufferedNet, batches, config, make_engine, train
from deepspeed_runs import TiedLM
from harness import spawn
from zengine.utils import safe_get_full_fp32_param, zero_to_fp32

FIXTURES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "deepspeed"
)
EXPECTED = torch.load(os.path.join(FIXTURES, "zero_to_fp32_0.19.8.pt"))
DS_FIXTURES = sorted(k for k in EXPECTED if k != "deepspeed_version")
TAG = "global_step3"
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(zengine.__file__)))


def _expected(name: str, trained_only: bool = False) -> dict[str, torch.Tensor]:
    """What DeepSpeed 0.19.8's zero_to_fp32 gave for the fixture; for the one it refuses (its bf16
    optimizer's files), what DeepSpeed reported at the save (reference.pt)."""
    if "error" not in EXPECTED[name]:
        return dict(EXPECTED[name]["trained" if trained_only else "full"]["items"])
    ref = torch.load(os.path.join(FIXTURES, name, "reference.pt"), weights_only=False)
    out = {"position_scale": torch.linspace(0.5, 1.5, 5), **ref["at_save"]}
    out["lm_head.weight"] = out["wte.weight"]
    return out if trained_only else {**out, **ref["frozen_at_save"]}


def _check_deepspeed(name: str, got: dict, trained_only: bool = False) -> None:
    want = _expected(name, trained_only)
    frozen = {"frozen.weight", "frozen.bias"}
    # DeepSpeed's tool drops the frozen parameters at stage 1 (no frozen_param_shapes there); zengine keeps them
    extra = set(got) - set(want)
    assert extra == (frozen if name == "s1_fp32_w2" and not trained_only else set()), extra
    assert not set(want) - set(got)
    for key, value in want.items():
        # frozen parameters: DeepSpeed keeps the training dtype, zengine gives fp32 of the same values
        assert got[key].dtype == (value.dtype if key not in frozen else torch.float32), key
        assert torch.equal(got[key].to(value.dtype), value), key
    ref = torch.load(os.path.join(FIXTURES, name, "reference.pt"), weights_only=False)
    if not trained_only:
        for key, value in ref["frozen_at_save"].items():
            assert torch.equal(got[key], value.float()), key
    # tied: one tensor, as DeepSpeed gives it
    assert got["lm_head.weight"].data_ptr() == got["wte.weight"].data_ptr()


@pytest.mark.parametrize("name", DS_FIXTURES)
def test_deepspeed_checkpoint_gives_deepspeeds_state_dict(name):
    save_dir = os.path.join(FIXTURES, name)
    _check_deepspeed(name, zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(save_dir))
    trained = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
        save_dir, TAG, exclude_frozen_parameters=True
    )
    _check_deepspeed(name, trained, trained_only=True)
    # one tag's folder, and lazy_mode (its values answer .contiguous())
    lazy = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
        os.path.join(save_dir, TAG), lazy_mode=True
    )
    _check_deepspeed(name, {k: v.contiguous() for k, v in lazy.items()})


@pytest.mark.parametrize("name", ["s2_bf16_w2", "s3_fp32_w2", "s1_bf16_w2"])
def test_deepspeed_checkpoint_load_and_convert(name, tmp_path):
    save_dir = os.path.join(FIXTURES, name)
    model = zero_to_fp32.load_state_dict_from_zero_checkpoint(TiedLM(), save_dir)
    _check_deepspeed(
        name, {k: v.float() if k.startswith("frozen") else v for k, v in model.state_dict().items()}
    )
    path = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(save_dir, str(tmp_path / "out"))
    assert path == str(tmp_path / "out" / "pytorch_model.bin")
    _check_deepspeed(name, torch.load(path))
    path = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
        save_dir,
        str(tmp_path / "st"),
        safe_serialization=True,
        tag=TAG,
        exclude_frozen_parameters=True,
    )
    from zengine.checkpoint import load_safetensors_state_dict

    _check_deepspeed(name, load_safetensors_state_dict(path), trained_only=True)
    path = zero_to_fp32.convert_zero_checkpoint_to_state_dict(
        save_dir, str(tmp_path / "bf"), dtype="bf16"
    )
    halves = torch.load(path)
    for key, value in _expected(name).items():
        assert halves[key].dtype == torch.bfloat16 and torch.equal(halves[key], value.bfloat16()), (
            key
        )


@pytest.mark.parametrize("safe", [False, True])
def test_max_shard_size_writes_shards_and_index(safe, tmp_path):
    # as DeepSpeed 0.19.8: shards of at most max_shard_size (Hugging Face's names) and their index
    save_dir = os.path.join(FIXTURES, "s3_bf16_w3")
    out = tmp_path / "sharded"
    index_path = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
        save_dir, str(out), max_shard_size="3KB", safe_serialization=safe
    )
    name = "model.safetensors" if safe else "pytorch_model.bin"
    assert index_path == str(out / f"{name}.index.json")
    index = json.loads(open(index_path).read())
    files = sorted(set(index["weight_map"].values()))
    stem, ext = os.path.splitext(name)
    assert files == [f"{stem}-{i:05d}-of-{len(files):05d}{ext}" for i in range(1, len(files) + 1)]
    assert len(files) > 2 and sorted(os.listdir(out)) == sorted(files + [f"{name}.index.json"])
    from zengine.checkpoint import load_safetensors_state_dict

    merged = {}
    for f in files:
        part = load_safetensors_state_dict(str(out / f)) if safe else torch.load(out / f)
        assert set(part) == {k for k, v in index["weight_map"].items() if v == f}
        merged.update(part)
    expected = _expected("s3_bf16_w3")
    assert set(merged) == set(expected)
    for key, value in expected.items():  # the converter writes every floating tensor in fp32
        assert merged[key].dtype == torch.float32 and torch.equal(merged[key], value.float()), key
    assert index["metadata"]["total_size"] == sum(
        v.numel() * 4 for k, v in expected.items() if k != "lm_head.weight"
    )


def _save_zengine(root: str) -> None:
    """Two zengine checkpoints (stage 2 bf16, stage 3 fp32) and the engine's own full fp32 masters at each."""
    for stage, precision in ((2, "bf16"), (3, "fp32")):
        engine = make_engine(config(stage, precision), seed=0)
        train(engine, batches(2))
        save_dir = os.path.join(root, f"s{stage}_{precision}")
        engine.save_checkpoint(save_dir, tag="step2", client_state={"epoch": 7})
        masters = {
            n: safe_get_full_fp32_param(p)
            for n, p in engine.module.named_parameters()
            if p.requires_grad
        }
        with engine.summon_full_params(writeback=False):
            frozen = {
                n: p.detach().float().clone()
                for n, p in engine.module.named_parameters()
                if not p.requires_grad
            }
        if dist.get_rank() == 0:
            torch.save(
                {"masters": masters, "frozen": frozen, "scale": engine.module.scale.clone()},
                os.path.join(root, f"s{stage}_{precision}.pt"),
            )


@pytest.fixture(scope="module")
def zengine_saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("zengine_fp32"))
    spawn(_save_zengine, 2, root)
    return root


ZENGINE_CASES = ["s2_bf16", "s3_fp32"]


def _check_zengine(root: str, case: str, got: dict, trained_only: bool = False) -> None:
    engine_view = torch.load(os.path.join(root, f"{case}.pt"))
    want = dict(engine_view["masters"])
    if not trained_only:
        want.update(engine_view["frozen"])
    want["scale"] = engine_view["scale"]
    want["head.weight"] = want["emb.weight"]
    assert set(got) == set(want), set(got) ^ set(want)
    for key, value in want.items():  # parameters in fp32, the buffer as the engine held it
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        assert key == "scale" or value.dtype == torch.float32, key
    assert got["head.weight"].data_ptr() == got["emb.weight"].data_ptr()


@pytest.mark.parametrize("case", ZENGINE_CASES)
def test_zengine_checkpoint_helpers(zengine_saved, case, tmp_path):
    save_dir = os.path.join(zengine_saved, case)
    _check_zengine(
        zengine_saved, case, zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(save_dir)
    )
    got = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
        save_dir, "step2", exclude_frozen_parameters=True
    )
    _check_zengine(zengine_saved, case, got, trained_only=True)
    model = zero_to_fp32.load_state_dict_from_zero_checkpoint(BufferedNet(), save_dir)
    loaded = model.state_dict()  # (the fp32 model's buffer holds the bf16 engine's value, in fp32)
    loaded["scale"] = loaded["scale"].to(got["scale"].dtype)
    _check_zengine(zengine_saved, case, loaded)
    path = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(save_dir, str(tmp_path / "out"))
    written = torch.load(path)  # buffers in fp32 too here, as DeepSpeed's converter writes them
    assert written["scale"].dtype == torch.float32
    written["scale"] = written["scale"].to(got["scale"].dtype)
    _check_zengine(zengine_saved, case, written)


LIGHTNING = """
import sys
import zengine.compat
zengine.compat.install()
from pytorch_lightning.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
for checkpoint_dir, output_file in zip(sys.argv[1::2], sys.argv[2::2]):
    convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file)
"""


def _plain_env() -> dict:
    """Only zengine on the path, compat mode off: what a user with zengine installed and no DeepSpeed has."""
    env = dict(os.environ)
    env.pop("ZENGINE_DEEPSPEED_COMPAT", None)
    env["PYTHONPATH"] = PACKAGE_ROOT
    return env


def _run(*argv: str) -> None:
    out = subprocess.run(
        [sys.executable, *argv], env=_plain_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]


def test_lightning_converter_on_both_kinds(zengine_saved, tmp_path):
    # Lightning's own converter (pytorch_lightning.utilities.deepspeed), zengine standing in for DeepSpeed
    ds_names = ("s2_fp32_w2", "s3_bf16_w3", "s1_bf16_w2")
    pairs = [(os.path.join(FIXTURES, n), str(tmp_path / f"{n}.pt")) for n in ds_names]
    pairs += [(os.path.join(zengine_saved, c), str(tmp_path / f"{c}.pt")) for c in ZENGINE_CASES]
    _run("-c", LIGHTNING, *[arg for pair in pairs for arg in pair])
    for name in ds_names:
        saved = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        _check_deepspeed(name, saved["state_dict"])
        assert saved["epoch"] == 7  # the client_state kept, as Lightning keeps its own there
    for case in ZENGINE_CASES:
        saved = torch.load(tmp_path / f"{case}.pt", weights_only=False)
        _check_zengine(zengine_saved, case, saved["state_dict"])
        assert saved["epoch"] == 7


def test_scripts_beside_checkpoints_run_with_plain_python(zengine_saved, tmp_path):
    scripts = (
        "zero_to_fp32.py",
        "zero_to_torch.py",
    )  # what DeepSpeed 0.19.8 copies beside its checkpoints
    for case in ZENGINE_CASES:
        save_dir = os.path.join(zengine_saved, case)
        assert all(os.access(os.path.join(save_dir, s), os.X_OK) for s in scripts)
        _run(os.path.join(save_dir, "zero_to_fp32.py"), save_dir, str(tmp_path / f"{case}.bin"))
        written = torch.load(tmp_path / f"{case}.bin")
        written["scale"] = written["scale"].to(
            torch.load(os.path.join(zengine_saved, f"{case}.pt"))["scale"].dtype
        )
        _check_zengine(zengine_saved, case, written)
        _run(
            os.path.join(save_dir, "zero_to_torch.py"),
            save_dir,
            str(tmp_path / f"{case}_h"),
            "--dtype",
            "fp16",
        )
        halves = torch.load(tmp_path / f"{case}_h" / "pytorch_model.bin")
        assert all(v.dtype == torch.float16 for v in halves.values())
    # the same scripts in a DeepSpeed-written folder, where DeepSpeed's own would be
    ds = tmp_path / "ds"
    shutil.copytree(os.path.join(FIXTURES, "s3_bf16_w3"), ds)
    for script in scripts:
        shutil.copy(os.path.join(zengine_saved, "s2_bf16", script), ds / script)
    _run(str(ds / "zero_to_fp32.py"), str(ds), str(tmp_path / "ds_out"), "--safe_serialization")
    from zengine.checkpoint import load_safetensors_state_dict

    _check_deepspeed(
        "s3_bf16_w3", load_safetensors_state_dict(str(tmp_path / "ds_out" / "model.safetensors"))
    )
    _run(
        str(ds / "zero_to_torch.py"),
        str(ds),
        str(tmp_path / "ds_bf16.pt"),
        "--dtype",
        "bf16",
        "-t",
        TAG,
    )
    halves = torch.load(tmp_path / "ds_bf16.pt")
    for key, value in _expected("s3_bf16_w3").items():
        assert torch.equal(halves[key], value.bfloat16()), key


def _deepspeed_scripts() -> str:
    """The folder of DeepSpeed's own zero_to_fp32.py and zero_to_torch.py (the ones it copies into
    every checkpoint folder), from a Python with DeepSpeed (ZENGINE_DEEPSPEED_PYTHON, else /tmp/dsv's);
    skips the test without one (their code is DeepSpeed's: read from its install, not committed)."""
    python = os.environ.get("ZENGINE_DEEPSPEED_PYTHON", "/tmp/dsv/bin/python")
    probe = None
    if os.path.isfile(python):
        probe = subprocess.run(
            [python, "-c", "import deepspeed.utils.zero_to_fp32 as m; print(m.__file__)"],
            capture_output=True,
            text=True,
            env={**os.environ, "DS_ACCELERATOR": "cpu"},
        )
    if probe is None or probe.returncode != 0:
        pytest.skip(f"no Python with DeepSpeed at {python} (set ZENGINE_DEEPSPEED_PYTHON)")
    return os.path.dirname(probe.stdout.strip().splitlines()[-1])


def test_deepspeeds_own_scripts_run_on_zengine_under_compat(tmp_path):
    # A DeepSpeed checkpoint folder holds DeepSpeed's zero_to_fp32.py / zero_to_torch.py, which import
    # deepspeed.checkpoint.constants and unpickle DeepSpeed's classes; with ZENGINE_DEEPSPEED_COMPAT=1
    # and only zengine installed they run and give what DeepSpeed 0.19.8 gave (one fixture per stage).
    scripts = _deepspeed_scripts()
    env = {**_plain_env(), "ZENGINE_DEEPSPEED_COMPAT": "1"}
    for name in ("s1_fp32_w2", "s2_bf16_w2", "s3_bf16_w3"):
        folder = tmp_path / name
        shutil.copytree(os.path.join(FIXTURES, name), folder)
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            shutil.copy(os.path.join(scripts, script), folder / script)
        argv = [str(folder / "zero_to_fp32.py"), str(folder), str(tmp_path / f"{name}_out")]
        out = subprocess.run(
            [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        got = torch.load(tmp_path / f"{name}_out" / "pytorch_model.bin")
        want = dict(EXPECTED[name]["full"]["items"])
        assert set(got) == set(want), set(got) ^ set(want)
        assert all(torch.equal(got[k], v) for k, v in want.items())
    # zero_to_torch.py (it imports the zero_to_fp32.py beside it) in bf16, at stage 3
    argv = [
        str(folder / "zero_to_torch.py"),
        str(folder),
        str(tmp_path / "bf16"),
        "--dtype",
        "bf16",
    ]
    out = subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    halves = torch.load(tmp_path / "bf16" / "pytorch_model.bin")
    want = dict(EXPECTED["s3_bf16_w3"]["full"]["items"])
    assert all(torch.equal(halves[k], v.bfloat16()) for k, v in want.items())
    # without the switch the script stops at its first import, as it would with nothing installed
    out = subprocess.run(
        [sys.executable, str(folder / "zero_to_fp32.py"), str(folder), str(tmp_path / "x")],
        env=_plain_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "deepspeed" in out.stderr
