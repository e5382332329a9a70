"""World size 2 on the GPU: the collectives' real paths, which the world-size-1 suite (test_gpu_training.py)
never reaches (its all-gathers, bucket reductions and the step's all-reduce return early).

Two levels, each proving something different:

- two GPUs (NCCL, rank r on cuda:r), where the machine has them: what a multi-GPU node runs, NCCL's own
  ordering and stream semantics included;
- one GPU shared by two processes under gloo (``ZENGINE_DEVICE=cuda:0`` on both; NCCL refuses two ranks
  on one device): not NCCL, but every world-size-2 path of the engine (bucketed reduction, the sharded
  step, stage 3's gathers and their check, the step's agreement) runs on CUDA tensors, with the side
  streams and events of offload, and is checked against plain torch on the same GPU. Gloo's CUDA
  collectives synchronize the stream they run on, so an event zengine forgot can hide here: only the
  NCCL level proves the ordering.

The cases are ``cuda_runs``' (the same checks as the world-size-1 suite), a few per stage.
"""

import pytest
import torch

from cuda_runs import run_groups, spawn_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PLAN = {
    "parity": [
        (0, "bf16", "none", 2, False),
        (1, "fp32", "cpu", 1, True),
        (2, "fp32", "none", 2, False),
        (2, "bf16", "cpu", 1, False),
        (3, "fp32", "none", 1, False),
        (3, "bf16", "param", 2, False),
        (3, "fp16", "none", 1, False),
    ],
    "overflow": [(2, "none", "inf"), (3, "none", "scale")],
    "init": [("bf16", "none")],
}


def _check(results: list, devices: list) -> None:
    for rank, (result, device) in enumerate(zip(results, devices)):
        assert result["process"]["device"] == device, (rank, result["process"])
        failures = {
            f"{group}/{cid}": r["errors"]
            for group in PLAN
            for cid, r in result[group].items()
            if r["errors"]
        }
        assert not failures, (rank, failures)


@pytest.fixture(scope="module")
def shared_gpu(tmp_path_factory):
    nvme = str(tmp_path_factory.mktemp("cuda-w2-nvme"))
    return spawn_backend(
        run_groups, 2, "gloo", PLAN, "cuda", nvme, env={"ZENGINE_DEVICE": "cuda:0"}, timeout=900
    )


def test_two_ranks_sharing_one_gpu_train_like_torch(shared_gpu):
    assert [r["process"]["backend"] for r in shared_gpu] == ["gloo", "gloo"]
    _check(shared_gpu, ["cuda:0", "cuda:0"])


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL takes one rank per GPU)"
)
def test_two_gpus_on_nccl_train_like_torch(tmp_path):
    results = spawn_backend(
        run_groups,
        2,
        "nccl",
        PLAN,
        "cuda",
        str(tmp_path),
        env={"ZENGINE_DEVICE": None},
        timeout=900,
    )
    assert [r["process"]["backend"] for r in results] == ["nccl", "nccl"]
    _check(results, ["cuda:0", "cuda:1"])
