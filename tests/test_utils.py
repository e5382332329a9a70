"""``zengine.utils`` / ``zengine.runtime``: RepeatingLoader, set_random_seed, log_dist, zero_to_fp32's
DeepSpeed signature (a folder or a file)."""

import logging
import os
import random

import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from zengine.runtime.utils import set_random_seed
from zengine.utils import RepeatingLoader, log_dist, logger
from zengine.utils import zero_to_fp32


def test_repeating_loader_starts_over_with_a_new_epoch():
    data = TensorDataset(torch.arange(6))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    loader = RepeatingLoader(DataLoader(data, batch_size=3, sampler=sampler))
    first = [next(loader)[0].tolist() for _ in range(2)]
    second = [next(loader)[0].tolist() for _ in range(2)]
    assert sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(6))
    assert first != second and loader.epoch == 1  # set_epoch reshuffled the second pass
    assert len(loader) == 2
    sampler.set_epoch(5)  # a resumed run sets its epoch before wrapping: it is kept
    assert RepeatingLoader(DataLoader(data, batch_size=3, sampler=sampler)).epoch == 5


def test_set_random_seed_repeats_every_generator():
    set_random_seed(5)
    a = (random.random(), torch.rand(2).tolist())
    set_random_seed(5)
    assert (random.random(), torch.rand(2).tolist()) == a


def test_log_dist_logs_on_the_ranks_named(caplog, monkeypatch):
    import torch.distributed as dist

    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="zengine"):
            log_dist("before the group", ranks=[3])  # no process group: always, as rank -1
            monkeypatch.setattr(dist, "is_initialized", lambda: True)
            monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
            log_dist("hello", ranks=[0])
            log_dist("not me", ranks=[1])
            log_dist("nobody", ranks=None)
            log_dist("everyone", ranks=[-1])
    finally:
        logger.propagate = False
    text = caplog.text
    assert (
        "[Rank -1] before the group" in text
        and "[Rank 0] hello" in text
        and "[Rank 0] everyone" in text
    )
    assert "not me" not in text and "nobody" not in text


def test_zero_to_fp32_writes_into_a_folder_or_a_file(tmp_path, monkeypatch):
    written = []
    monkeypatch.setattr(
        zero_to_fp32._fp32,
        "convert_zero_checkpoint_to_fp32_state_dict",
        lambda ckpt, path, tag, *rest: written.append((ckpt, path, tag, *rest)),
    )

    def shards(ckpt, folder, name, max_shard_size, tag, exclude_frozen, dtype):  # into a folder
        written.append((ckpt, os.path.join(folder, name), tag, exclude_frozen))
        return [os.path.join(folder, name)]

    monkeypatch.setattr(zero_to_fp32._shards, "write_shards", shards)
    out = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
        "ck", str(tmp_path / "out"), tag="t"
    )
    assert out == str(tmp_path / "out" / "pytorch_model.bin") and (tmp_path / "out").is_dir()
    out = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
        "ck", str(tmp_path / "o2"), safe_serialization=True
    )
    assert out.endswith("model.safetensors")
    out = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict("ck", str(tmp_path / "model.pt"))
    assert out == str(tmp_path / "model.pt")
    assert [w[2] for w in written] == ["t", None, None]
    assert zero_to_fp32.main(["ck", str(tmp_path / "o3"), "--exclude_frozen_parameters"]) == 0
    assert written[-1][3] is True  # exclude_frozen_parameters passed on
