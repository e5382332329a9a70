"""The fp32 export (function and zengine-to-fp32) equals the gathered parameters exactly, whatever stage and world
size saved; save_16bit_model writes the whole model in the compute dtype; the export's peak memory stays near
the largest tensor."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from checkpoint_runs import BufferedNet, batches, config, full_params, make_engine, train
from harness import spawn
from zengine.checkpoint import get_fp32_state_dict_from_zero_checkpoint
from zengine.checkpoint.native.tensorfile import TensorFileReader
from zengine.checkpoint.export.to_fp32 import main as to_fp32

CASES = [(3, "fp32"), (0, "fp32"), (2, "bf16")]


def save_cases(root: str) -> None:
    save_wide(os.path.join(root, "wide"))
    for stage, precision in CASES:
        cfg = config(stage, precision)
        cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        engine = make_engine(cfg, seed=0)
        engine.module.scale.add_(2.0)
        train(engine, batches(2))
        path = os.path.join(root, f"{stage}-{precision}")
        engine.save_checkpoint(path)
        assert engine.save_16bit_model(path, "model16.bin") and engine.save_16bit_model(
            path, "model16.safetensors"
        )
        if (
            stage == 3
        ):  # as in DeepSpeed, stage 3 gathers 16-bit weights for saving only when asked to
            engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save = False
            assert engine.save_16bit_model(path, "not-saved.bin") is False
            assert not os.path.exists(os.path.join(path, "not-saved.bin"))
        params = full_params(engine)
        if dist.get_rank() == 0:
            torch.save(
                {"params": params, "state_dict_keys": list(BufferedNet().state_dict())},
                os.path.join(path, "gathered.pt"),
            )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("export"))
    spawn(save_cases, 2, root)
    return root


def _read_safetensors(path):
    reader = TensorFileReader(path)
    try:
        return {k: reader.read(k) for k in reader.entries}
    finally:
        reader.close()


@pytest.mark.parametrize("stage,precision", CASES)
def test_fp32_export_equals_gathered_parameters(saved, tmp_path, stage, precision):
    path = os.path.join(saved, f"{stage}-{precision}")
    gathered = torch.load(os.path.join(path, "gathered.pt"))
    params, keys = gathered["params"], gathered["state_dict_keys"]
    exported = get_fp32_state_dict_from_zero_checkpoint(path)
    assert (
        list(exported) == keys
    )  # the model's state_dict keys and order: tied head.weight, the buffer
    assert exported["head.weight"] is exported["emb.weight"]
    assert torch.equal(exported["scale"], torch.arange(3.0) + 2.0)
    for name, p in params.items():
        assert exported[name].dtype == torch.float32
        assert torch.equal(exported[name].to(p.dtype), p), name
        if precision == "fp32":
            assert torch.equal(exported[name], p), name

    assert to_fp32([path, str(tmp_path / "model.pt")]) == 0
    loaded = torch.load(tmp_path / "model.pt", mmap=True, weights_only=True)
    assert list(loaded) == keys and all(torch.equal(loaded[k], exported[k]) for k in keys)
    assert (
        loaded["head.weight"].untyped_storage().data_ptr()
        == loaded["emb.weight"].untyped_storage().data_ptr()
    )


def test_fp32_export_to_safetensors(saved, tmp_path):
    path = os.path.join(saved, "3-fp32")
    out = str(tmp_path / "model.safetensors")
    assert to_fp32([path, out, "--tag", "global_step2"]) == 0
    exported = get_fp32_state_dict_from_zero_checkpoint(path, tag="global_step2")
    written = _read_safetensors(out)
    # the tied head once, as Hugging Face's save_pretrained writes it (its name in the metadata)
    assert list(written) == [k for k in exported if k != "head.weight"]
    assert all(torch.equal(written[k], exported[k]) for k in written)
    try:
        from zengine.checkpoint import load_safetensors_state_dict

        every = load_safetensors_state_dict(out)
    except ImportError:
        return
    assert list(sorted(every)) == sorted(exported) and all(
        torch.equal(every[k], exported[k]) for k in exported
    )
    assert every["head.weight"] is every["emb.weight"]


@pytest.mark.parametrize("stage,precision", CASES)
def test_16bit_model(saved, stage, precision):
    path = os.path.join(saved, f"{stage}-{precision}")
    gathered = torch.load(os.path.join(path, "gathered.pt"))
    for written in (
        torch.load(os.path.join(path, "model16.bin"), weights_only=True),
        _read_safetensors(os.path.join(path, "model16.safetensors")),
    ):
        assert list(written) == gathered["state_dict_keys"]
        for name, p in gathered["params"].items():
            assert written[name].dtype == p.dtype and torch.equal(written[name], p), name
        assert torch.equal(written["head.weight"], written["emb.weight"])
        assert torch.equal(written["scale"], torch.arange(3.0) + 2.0)


# -- peak memory of the export ---------------------------------------------------------------------
LAYERS, WIDTH = 8, 2048  # 8 tensors of 4M fp32 elements (16 MiB) plus biases: 128 MiB of parameters


def save_wide(path: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    engine, *_ = zengine.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 1},
            "steps_per_print": 1000,
        },
    )
    engine.backward(engine(torch.randn(1, WIDTH)).pow(2).mean())
    engine.step()
    engine.save_checkpoint(path)


# The export's own peak: the high-water mark restarts after the imports (clear_refs "5"), and the
# file-backed pages (libtorch's code faulted in on first use, more of it when the page cache was under
# pressure before the export started) are left out, as they are not the export's memory.
MEASURE = textwrap.dedent("""
    import json, sys
    from zengine.checkpoint.export.to_fp32 import main

    def status():
        with open("/proc/self/status") as f:
            return {k: int(v.split()[0]) << 10 for k, v in (ln.split(":", 1) for ln in f) if "kB" in v}

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status()
    assert main(sys.argv[1:3]) == 0
    after = status()
    peak = after["VmHWM"] - after["RssFile"] - after["RssShmem"]
    print(json.dumps({"before": before["RssAnon"], "peak": peak, "file": after["RssFile"] - before["RssFile"]}))
""")


def test_export_peak_memory(saved, tmp_path):
    path = os.path.join(saved, "wide")
    out = str(tmp_path / "wide.pt")
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, path, out], capture_output=True, text=True, check=True
    )
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    extra = measured["peak"] - measured["before"]  # an upper bound on the anonymous memory it added
    largest = WIDTH * WIDTH * 4
    total = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    assert extra <= 1.5 * largest + (200 << 20), f"export peak {extra >> 20} MiB"
    assert extra < total / 2, (
        f"export peak {extra >> 20} MiB for a {total >> 20} MiB model: not streaming ({measured})"
    )
    written = torch.load(out, mmap=True, weights_only=True)
    assert len(written) == 2 * LAYERS and written["7.weight"].shape == (WIDTH, WIDTH)
