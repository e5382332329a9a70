"""Checkpoints cross devices: saved by the GPU process (NCCL, W=1, cuda:0) they load on two CPU gloo ranks
and the run continues with the losses of the uninterrupted GPU run; saved by two CPU ranks they load on
the GPU and continue like the uninterrupted CPU run. Right after loading the parameters equal the saved
ones exactly.

Three processes for all cases (``cuda_runs.checkpoint_roundtrip``): CPU ranks save, the GPU process
saves and loads the CPU checkpoints, CPU ranks load the GPU checkpoints.
"""

import pytest
import torch

from cuda_runs import checkpoint_failures, checkpoint_roundtrip, ckpt_id

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# (stage, precision, optimizer offload when saving, when loading); each side at its own world size. The last
# two change the optimizer between save and load: torch's fused AdamW <-> CPUAdam (host). Loaded on the GPU,
# a fused AdamW needs its ``step`` on the GPU, and a checkpoint written by CPUAdam does not say "fused":
# that case comes last, so that a CUDA error there cannot spoil the other cases of the GPU process.
CASES = [
    (2, "fp32", "none", "none"),
    (3, "fp32", "cpu", "cpu"),
    (1, "bf16", "none", "none"),
    (0, "fp16", "none", "none"),
    (3, "fp32", "none", "cpu"),
    (2, "fp32", "cpu", "none"),
]


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory):
    return checkpoint_roundtrip(str(tmp_path_factory.mktemp("cuda-ckpt")), CASES, "cuda", "nccl")


@pytest.mark.parametrize("direction", ["gpu-to-cpu", "cpu-to-gpu"])
@pytest.mark.parametrize("case", CASES, ids=ckpt_id)
def test_checkpoint_crosses_devices(roundtrip, case, direction):
    errors = checkpoint_failures(roundtrip, case, direction.replace("gpu", "device"))
    assert not errors, "\n".join(errors)
