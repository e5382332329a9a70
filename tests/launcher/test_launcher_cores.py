"""--bind_cores_to_rank / --bind_core_list: each rank of a node pinned to its own share of the cores,
with as many threads (DeepSpeed's launcher options)."""

import json
import os

import pytest

from test_launcher_launch import launch
from zengine.launcher.cores import CoreBindingError, cores_for_rank, parse_core_list

AFFINITY_SCRIPT = """
import json, os, torch
rec = {"cores": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
       "omp": os.environ.get("OMP_NUM_THREADS")}
with open("rank%s.json" % os.environ["RANK"], "w") as f:
    json.dump(rec, f)
"""


def test_core_lists_parse_as_deepspeed_reads_them():
    assert parse_core_list("1,3-5,7") == [1, 3, 4, 5, 7]
    assert parse_core_list("0-3") == [0, 1, 2, 3]
    for bad in ("3-1", "a", "0-2,2-4", "4,1", "1-"):
        with pytest.raises(CoreBindingError, match="bind_core_list"):
            parse_core_list(bad)


def test_each_rank_gets_a_consecutive_share():
    cores = parse_core_list("0-15,32-47")
    assert cores_for_rank(cores, 4, 0) == list(range(8))
    assert cores_for_rank(cores, 4, 3) == list(range(40, 48))
    assert cores_for_rank([0, 1, 2], 2, 1) == [1]  # the leftover core stays unused, as DeepSpeed's
    with pytest.raises(CoreBindingError, match="cannot give each of 3 ranks"):
        cores_for_rank([0, 1], 3, 0)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_two_ranks_run_pinned_to_a_core_each(tmp_path):
    (tmp_path / "script.py").write_text(AFFINITY_SCRIPT)
    usable = sorted(os.sched_getaffinity(0))[:2]
    listed = ",".join(map(str, usable))
    result = launch(
        tmp_path,
        *["--num_procs", "2", "--bind_cores_to_rank", "--bind_core_list", listed, "script.py"],
    )
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        rec = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rec == {"cores": [usable[rank]], "threads": 1, "omp": "1"}, rec


def test_bad_binding_is_refused_before_any_rank_starts(tmp_path):
    (tmp_path / "script.py").write_text(AFFINITY_SCRIPT)
    too_few = launch(
        tmp_path, "--num_procs", "2", "--bind_cores_to_rank", "--bind_core_list", "0", "script.py"
    )
    assert too_few.returncode != 0 and "cannot give each of 2 ranks" in too_few.stderr
    alone = launch(tmp_path, "--num_procs", "2", "--bind_core_list", "0-1", "script.py")
    assert alone.returncode != 0 and "add it" in alone.stderr
    assert not list(tmp_path.glob("rank*.json"))  # nothing started
