"""Exact resume: stopped, saved, loaded into a fresh engine and continued, a run matches one that never stopped
bit for bit (losses, parameters, fp32 masters, counters, learning rate, loss scale), at every stage."""

import os

import torch

from checkpoint_runs import batches, config, full_params, make_engine, train
from harness import spawn

STEPS, STOP = 5, 2


def resume_case(root: str, stage: int, precision: str, offload=False) -> dict:
    cfg = config(stage, precision, offload, scheduler=True)
    data = batches(STEPS)
    whole = make_engine(cfg, seed=0)
    whole.module.scale.add_(1.0)  # a buffer that differs from a fresh model's
    expected = train(whole, data)

    first = make_engine(cfg, seed=0)
    first.module.scale.add_(1.0)
    train(first, data[:STOP])
    path = os.path.join(root, f"stage{stage}-{precision}-{offload}")
    first.save_checkpoint(path, client_state={"epoch": 7})

    second = make_engine(
        cfg, seed=1
    )  # other initial weights: everything must come from the checkpoint
    loaded, client = second.load_checkpoint(path)
    resumed = train(second, data[STOP:])

    same_params = all(
        torch.equal(a, b) for a, b in zip(full_params(whole).values(), full_params(second).values())
    )
    with (
        whole.optimizer.states_resident(),
        second.optimizer.states_resident(),
    ):  # (swapped masters read in)
        same_masters = all(
            torch.equal(a, b) for a, b in zip(whole.optimizer.masters, second.optimizer.masters)
        )
    return {
        "losses": expected[STOP:] == resumed,
        "params": same_params,
        "masters": same_masters,
        "buffer": torch.equal(whole.module.scale, second.module.scale),
        "counters": (whole.global_steps, whole.micro_steps, whole.global_samples)
        == (second.global_steps, second.micro_steps, second.global_samples),
        "lr": whole.get_lr() == second.get_lr(),
        "loss_scale": whole.loss_scale == second.loss_scale,
        "client": client,
        "path": loaded == os.path.join(path, f"global_step{STOP}"),
    }


def resume_matrix(root: str, cases) -> list:
    return [(case, resume_case(root, *case)) for case in cases]


CASES = [
    (0, "fp32"),
    (1, "fp32"),
    (2, "fp32"),
    (3, "fp32"),
    (2, "bf16"),
    (3, "bf16"),
    (1, "fp16"),
    (1, "fp32", "nvme"),
    (2, "bf16", "nvme"),
    (3, "fp32", "nvme"),
]


def test_resume_is_exact(tmp_path):
    for case, result in spawn(resume_matrix, 2, str(tmp_path), CASES)[0]:
        client = result.pop("client")
        assert client == {"epoch": 7}, case
        assert all(result.values()), f"{case}: differs in {[k for k, v in result.items() if not v]}"
