"""``save_checkpoint(exclude_frozen_parameters=True)``, as DeepSpeed and Hugging Face's Trainer use it
(the Trainer passes it for a PEFT model and resumes with ``load_module_strict=False``): the
parameters that do not require grad are left out of the checkpoint; a non-strict load keeps the
model's own values of them and restores everything else, a strict one names them missing, and the
fp32 export leaves them out.
"""

import pytest
import torch

import zengine
from checkpoint_runs import LR, BufferedNet, batches, config, full_params, train
from harness import spawn
from models import edge_param_groups
from zengine.checkpoint.errors import CheckpointMismatchError
from zengine.utils import zero_to_fp32

FROZEN = ("frozen.weight", "frozen.bias")


def _engine(cfg: dict, frozen_value: float = None):
    torch.manual_seed(0)
    model = BufferedNet()
    if frozen_value is not None:  # the model as built again, its frozen layer other than saved
        with torch.no_grad():
            model.frozen.weight.fill_(frozen_value)
    engine, *_ = zengine.initialize(
        model=model, config=cfg, model_parameters=edge_param_groups(model, LR)
    )
    return engine


def _run(root: str, stage: int) -> dict:
    cfg = config(stage)
    data = batches(4)
    engine = _engine(cfg)
    train(engine, data[:2])
    engine.save_checkpoint(root, tag="ex", exclude_frozen_parameters=True)
    want_losses = train(engine, data[2:])
    want = full_params(engine)
    strict = _engine(cfg, 0.25)
    with pytest.raises(CheckpointMismatchError, match="frozen.weight"):
        strict.load_checkpoint(root, tag="ex")
    resumed = _engine(cfg, 0.25)
    resumed.load_checkpoint(root, tag="ex", load_module_strict=False)
    kept = full_params(resumed)["frozen.weight"]
    # training with the frozen layer at 0.25 differs from the original run only through that layer:
    # put it back to compare the rest
    with resumed.summon_full_params(writeback=True), torch.no_grad():
        resumed.module.frozen.weight.copy_(want["frozen.weight"])
    losses = train(resumed, data[2:])
    got = full_params(resumed)
    exported = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(root, tag="ex")
    return {
        "kept": bool((kept == 0.25).all()),
        "losses": (losses, want_losses),
        "diff": max((got[n] - w).abs().max().item() for n, w in want.items()),
        "exported": sorted(exported),
        "params": sorted(want),
    }


@pytest.mark.parametrize("stage,world", [(1, 2), (3, 2), (3, 3)])
def test_frozen_parameters_left_out_and_kept_on_a_non_strict_load(tmp_path, stage, world):
    for out in spawn(_run, world, str(tmp_path), stage):
        assert out["kept"]  # not in the checkpoint: the model's own value stays
        assert out["losses"][0] == out["losses"][1], out["losses"]
        assert out["diff"] == 0.0, out["diff"]
        assert not set(FROZEN) & set(out["exported"]), out["exported"]
        assert set(out["exported"]) | set(FROZEN) >= set(out["params"]) - {"head.weight"}
