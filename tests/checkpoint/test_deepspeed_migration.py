"""DeepSpeed 0.19.8 checkpoints (tests/fixtures/deepspeed/, written by DeepSpeed itself: make_fixtures.py) load
into zengine at other world sizes and stages and continue as DeepSpeed continued; zengine writes them back.

Every fixture records what DeepSpeed reported at the save (fp32 masters through ``safe_get_full_fp32_param``;
masters, Adam moments and step through its offline ``ds_to_universal`` converter) and what it trained in the
CONTINUED steps after the save. Loading must reproduce the recorded state exactly (the bytes are copied, never
computed), and zengine's continuation must track DeepSpeed's within the rounding of the two engines' gradient
reductions (see the tolerances below).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import os
import re
import shutil

import pytest
import torch

import zengine
from zengine.checkpoint.deepspeed import partition
from zengine.checkpoint.deepspeed.export import export_deepspeed_checkpoint
from zengine.checkpoint.deepspeed.files import load_ds_file, save_ds_file
from zengine.checkpoint.deepspeed.layout import (
    Bf16OptimizerLayout,
    FlatGroup,
    Stage1Layout,
    Stage2Layout,
    Stage3Layout,
    layout_for,
)
from zengine.checkpoint.deepspeed.reader import (
    DeepSpeedCheckpointError,
    DeepSpeedReader,
    open_reader,
)
from zengine.checkpoint.errors import CheckpointFileError, CheckpointUntrustedError
from zengine.checkpoint.export import convert
from zengine.checkpoint.export.hf import export_safetensors, load_safetensors_state_dict
from zengine.checkpoint.native.holdings import Holding
from zengine.checkpoint.native.pieces import Piece
from zengine.checkpoint.native.reader import CheckpointReader
from deepspeed_runs import CONTINUED, SAVED_AT, TiedLM, batches, config, make_optimizer, train
from harness import spawn

FIXTURES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "deepspeed"
)
# fp32: both engines compute the same AdamW on the same summed gradients; only the order of the ranks'
# gradient sums and of the clipping norm differs (float rounding): measured at most 1.2e-7 on losses
# (relative) and masters after three steps, held to 1e-6. bf16: the forward runs in bf16 in both, but
# DeepSpeed reduces bf16 gradients while zengine accumulates and reduces them in fp32, and a master
# differing by one bf16 ulp rounds the next forward's weights apart: measured at most 5.2e-4 (losses,
# relative) and 3.7e-4 (masters), held to 2e-3 and 1.5e-3. Both are far below what a lost moment or a
# wrong step count makes (lr x steps = 3e-2 on the masters).
TOLERANCE = {"fp32": {"loss": 1e-6, "param": 1e-6}, "bf16": {"loss": 2e-3, "param": 1.5e-3}}


def reference(name: str) -> dict:
    return torch.load(os.path.join(FIXTURES, name, "reference.pt"), weights_only=True)


def _full_state(engine) -> dict:
    """zengine's fp32 masters and Adam moments of every trained parameter, whole, by name."""
    out = {"master": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            out["master"][name] = zengine.utils.safe_get_full_fp32_param(p).detach().cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[key][name] = (
                    zengine.utils.safe_get_full_optimizer_state(p, key).detach().cpu().clone()
                )
    return out


class RenamedLM(TiedLM):
    """TiedLM with one parameter under another name: a checkpoint of TiedLM is not this model's."""

    def __init__(self):
        super().__init__()
        self.norm = self.ln
        del self.ln

    def forward(self, x, y):
        self.ln = self.norm
        return super().forward(x, y)


def refused_before_any_change(fixture: str) -> dict:
    """Rank body: loading into a model with other parameter names raises, and no parameter has changed."""
    torch.manual_seed(1)
    model = RenamedLM()
    engine, *_ = zengine.initialize(
        model=model, optimizer=make_optimizer(model), config=config(2, "fp32", 1)
    )
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    try:
        engine.load_checkpoint(os.path.join(FIXTURES, fixture))
        error = None
    except Exception as e:  # the class and message are checked by the test
        error = (type(e).__name__, str(e))
    same = all(torch.equal(p.detach(), before[n]) for n, p in engine.module.named_parameters())
    engine.destroy()
    return {"error": error, "unchanged": same and engine.global_steps == 0}


def load_and_continue(targets: list, save_dir: str) -> bytes:
    """Rank body: for each (fixture, stage), a fresh engine (other initial weights) loads DeepSpeed's
    checkpoint, saves it as a zengine checkpoint in ``save_dir/<fixture>``, then trains CONTINUED steps.
    At W=1 it first tries a model with other parameter names (in this process group, to save a start-up)."""
    world = torch.distributed.get_world_size()
    out = [refused_before_any_change(targets[0][0])] if world == 1 else []
    for fixture, stage, precision in targets:
        torch.manual_seed(1)
        model = TiedLM()
        engine, *_ = zengine.initialize(
            model=model, optimizer=make_optimizer(model), config=config(stage, precision, world)
        )
        loaded, client_state = engine.load_checkpoint(os.path.join(FIXTURES, fixture))
        at_load = _full_state(engine)
        with torch.no_grad(), engine.summon_full_params(writeback=False):
            frozen = {
                n: p.detach().cpu().clone()
                for n, p in engine.module.named_parameters()
                if not p.requires_grad
            }
            tied = engine.module.lm_head.weight is engine.module.wte.weight
        counters = (engine.global_steps, engine.global_samples)
        engine.save_checkpoint(os.path.join(save_dir, fixture), client_state=client_state)
        losses = train(engine, batches(SAVED_AT + CONTINUED)[SAVED_AT:])
        out.append(
            {
                "loaded": loaded,
                "client_state": client_state,
                "at_load": at_load,
                "frozen": frozen,
                "tied": tied,
                "counters": counters,
                "losses": losses,
                "after": _full_state(engine)["master"],
            }
        )
        engine.destroy()
    buf = (
        io.BytesIO()
    )  # as bytes: tensors through the result queue would each hold a shared-memory handle
    torch.save(out, buf)
    return buf.getvalue()


def _results(raw: bytes):
    return torch.load(io.BytesIO(raw), weights_only=True)


def _worst(got: dict, want: dict) -> float:
    assert set(got) == set(want), (sorted(got), sorted(want))
    # flattened: DeepSpeed's universal files of a stage-3 checkpoint hold each parameter 1-D
    assert all(got[n].numel() == want[n].numel() for n in want), {
        n: (got[n].shape, want[n].shape) for n in want
    }
    return max(
        (got[n].float().reshape(-1) - want[n].float().reshape(-1)).abs().max().item() for n in want
    )


# world size -> [(fixture, stage)]: one process group per world size; every fixture loads into another world
# size or stage, every zengine stage gets fp32 and bf16, odd and even world sizes load into each other, and
# DeepSpeed's parameter_alignment padding (s2_bf16_w2_aligned) is read too
CASES = {
    1: [("s3_bf16_w2", 1), ("s2_fp32_w2", 2), ("s1_bf16_w2", 2)],
    2: [("s3_fp32_w2", 1), ("s2_bf16_w2", 3), ("s2_fp32_w3", 3), ("s3_bf16_w3", 2)],
    3: [("s1_fp32_w2", 3), ("s2_bf16_w2_aligned", 1)],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """world -> (targets, per-target results, the folder of the zengine checkpoints saved right after loading);
    one process group per world size, started when a test first asks for it."""
    cache: dict = {}

    def run(world: int):
        if world not in cache:
            save_dir = str(tmp_path_factory.mktemp(f"zengine-w{world}"))
            targets = [
                (fixture, stage, reference(fixture)["precision"]) for fixture, stage in CASES[world]
            ]
            cache[world] = (
                targets,
                _results(spawn(load_and_continue, world, targets, save_dir)[0]),
                save_dir,
            )
        return cache[world]

    return run


@pytest.mark.parametrize("world", sorted(CASES))
def test_deepspeed_checkpoint_continues(world, runs):
    targets, results, _ = runs(world)
    if world == 1:
        refusal, results = results[0], results[1:]
        assert refusal["error"] is not None and refusal["error"][0] == "CheckpointMismatchError", (
            refusal
        )
        assert "norm.weight" in refusal["error"][1] and "ln.weight" in refusal["error"][1], refusal[
            "error"
        ][1]
        assert refusal["unchanged"], "a refused load changed the engine"
    for (fixture, stage, precision), got in zip(targets, results):
        ref, tol = reference(fixture), TOLERANCE[precision]
        where = f"{fixture} -> zengine W={world} stage {stage}"
        trained = set(ref["at_save"])
        assert got["loaded"] == os.path.join(FIXTURES, fixture, ref["tag"]), where
        assert got["client_state"] == ref["client_state"], where
        assert got["counters"] == (SAVED_AT, SAVED_AT * 6), where
        # what DeepSpeed saved arrives exactly: masters (both of DeepSpeed's readings), moments, frozen weights
        assert _worst(got["at_load"]["master"], ref["at_save"]) == 0.0, where
        for key, ds_key in (
            ("master", "fp32"),
            ("exp_avg", "exp_avg"),
            ("exp_avg_sq", "exp_avg_sq"),
        ):
            universal = {n: t for n, t in ref["universal"][ds_key].items() if n in trained}
            assert _worst(got["at_load"][key], universal) == 0.0, f"{where}: {key}"
        assert _worst(got["frozen"], ref["frozen_at_save"]) == 0.0, where
        assert got["tied"], where
        # and trains on as DeepSpeed did
        assert got["losses"] == pytest.approx(ref["losses_after"], rel=tol["loss"]), where
        worst = _worst(got["after"], ref["after"])
        assert worst <= tol["param"], (
            f"{where}: masters after {CONTINUED} steps differ by {worst:.3g}"
        )


def deepspeed_continue(targets: list) -> bytes:
    """Rank body under DeepSpeed itself: load each export of zengine's, read its masters, train on."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    world = torch.distributed.get_world_size()
    out = []
    for path, stage, precision in targets:
        torch.manual_seed(1)
        model = TiedLM()
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=make_optimizer(model), config=config(stage, precision, world)
        )
        loaded, _ = engine.load_checkpoint(os.path.dirname(path))  # the save_dir, with its 'latest'
        assert loaded is not None, f"DeepSpeed found no checkpoint in {os.path.dirname(path)}"
        masters = {
            n: deepspeed.utils.safe_get_full_fp32_param(p).detach().cpu().clone()
            for n, p in engine.module.named_parameters()
            if p.requires_grad
        }
        out.append(
            {
                "masters": masters,
                "steps": engine.global_steps,
                "losses": train(engine, batches(SAVED_AT + CONTINUED)[SAVED_AT:]),
            }
        )
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _every_value(reader) -> dict:
    """Every master, frozen parameter and per-element optimizer state of a checkpoint, whole, by kind and name."""
    out = {}
    for name, entry in reader.meta["params"].items():
        numel = math.prod(entry["shape"])
        kinds = [("master", "param")] + (
            [("state.exp_avg",), ("state.exp_avg_sq",)] if entry["trained"] else []
        )
        for kind in kinds:
            whole = torch.zeros(numel)
            reader.fill(Holding(whole, [Piece(name, 0, numel, 0)]), kind)
            out[(kind[0], name)] = whole
    return out


# (world size, stage, precision) DeepSpeed would run the export with; bf16 at stage 1 is its bf16 optimizer
EXPORTS = [(3, 2), (2, 3), (2, 1)]


def test_export_round_trip(runs):
    """zengine -> DeepSpeed's layout -> zengine's reader: the same bytes for every master, moment and frozen
    weight, the same step, scheduler, counters and client_state, at world sizes and stages other than the
    checkpoint's."""
    targets, _, save_dir = runs(2)
    for fixture, _, precision in targets:
        with CheckpointReader(os.path.join(save_dir, fixture, "global_step3")) as ours:
            want, state = _every_value(ours), ours.read_state()
            groups = [list(g["step_counts"]) for g in state["optimizer"]]
            for world, stage in EXPORTS:
                where = f"{fixture} exported for W={world} stage {stage} {precision}"
                out = export_deepspeed_checkpoint(
                    os.path.join(save_dir, fixture),
                    os.path.join(save_dir, f"ds-{fixture}-{world}-{stage}"),
                    world,
                    config(stage, precision, world),
                )
                with open_reader(out, False, groups, 1) as back:
                    assert isinstance(back, DeepSpeedReader) and (back.world, back.stage) == (
                        world,
                        stage,
                    ), where
                    got = _every_value(back)
                    assert set(got) == set(want), where
                    assert all(torch.equal(got[k], want[k]) for k in want), where
                    again = back.read_state()
                    assert [g["scalars"] for g in again["optimizer"]] == [
                        {"step": g["scalars"]["step"]} for g in state["optimizer"]
                    ], where
                    assert again["lr_scheduler"] == state["lr_scheduler"], where
                    assert (
                        again["client_state"]
                        == state["client_state"]
                        == reference(fixture)["client_state"]
                    ), where
                    assert back.meta["global_steps"] == SAVED_AT and back.meta["shared_params"] == {
                        "lm_head.weight": "wte.weight"
                    }, where


def _copy(fixture: str, tmp_path) -> str:
    """A writable copy of a fixture's checkpoint folder."""
    path = str(tmp_path / fixture)
    shutil.copytree(os.path.join(FIXTURES, fixture, reference(fixture)["tag"]), path)
    return path


GROUPS = [
    ["wte.weight", "wpe.weight", "fc.weight", "proj.weight"],
    ["ln.weight", "ln.bias", "fc.bias", "proj.bias"],
]


@pytest.mark.parametrize(
    "extra,words",
    [
        ("mp_rank_01_model_states.pt", "tensor (model) parallel"),
        ("layer_01-model_00-model_states.pt", "pipeline-parallel"),
        ("expp_rank_0_mp_rank_00_optim_states.pt", "mixture-of-experts"),
    ],
)
def test_unsupported_deepspeed_layouts_are_refused(tmp_path, extra, words):
    path = _copy("s2_fp32_w2", tmp_path)
    open(os.path.join(path, extra), "wb").close()
    with pytest.raises(DeepSpeedCheckpointError, match=re.escape(words)) as e:
        open_reader(path, False, GROUPS, 1)
    assert extra in str(e.value) and "zero_to_fp32" in str(e.value)


def test_bad_deepspeed_checkpoints_are_refused_by_name(tmp_path):
    path = _copy("s2_fp32_w2", tmp_path)
    with pytest.raises(DeepSpeedCheckpointError, match="optimizer groups hold other parameters"):
        open_reader(
            path, False, GROUPS[::-1], 1
        ).read_state()  # the engine's groups in the other order
    os.remove(os.path.join(path, "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    with pytest.raises(CheckpointFileError, match="partitioned over \\[2\\] ranks but holds 1"):
        open_reader(path, False, GROUPS, 1)


def test_deepspeed_client_state_is_loaded_weights_only(tmp_path):
    """An object of another class in a DeepSpeed client_state is refused unless trusted (nothing runs)."""
    path = _copy("s1_fp32_w2", tmp_path)
    model_file = os.path.join(path, "mp_rank_00_model_states.pt")
    states = load_ds_file(model_file)
    states["args"] = argparse.Namespace(
        lr=0.5
    )  # as scripts keep their command line in client_state
    save_ds_file(states, model_file + ".new")  # then renamed: the loaded file is memory-mapped
    os.replace(model_file + ".new", model_file)
    with pytest.raises(CheckpointUntrustedError, match="argparse.Namespace"):
        open_reader(path, False, GROUPS, 1)
    with open_reader(path, True, GROUPS, 1) as reader:
        assert reader.read_state()["client_state"]["args"] == argparse.Namespace(lr=0.5)


def test_deepspeed_layout_arithmetic():
    """DeepSpeed's rules on sizes no world size divides: stage 1-2 partitions of a group of 5 + 3 elements
    over 3 ranks (aligned to 2 * 3 = 6: 12 elements, 4 per rank, the last rank only padding), stage-3
    chunks of ceil(numel / world)."""
    assert partition.partition_numel([5, 3], [0, 0], 3) == 4
    assert partition.flat_group_pieces(["a", "b"], [5, 3], None, 0, 4, 4) == [Piece("a", 0, 4, 0)]
    assert partition.flat_group_pieces(["a", "b"], [5, 3], None, 1, 4, 4) == [
        Piece("a", 4, 5, 0),
        Piece("b", 0, 3, 1),
    ]
    assert partition.flat_group_pieces(["a", "b"], [5, 3], None, 2, 4, 0) == []
    assert partition.flat_group_pieces(["a", "b"], [5, 3], [3, 0], 1, 4, 4) == [Piece("a", 4, 5, 0)]
    assert partition.flat_group_pieces(["a", "b"], [5, 3], [3, 0], 2, 4, 4) == [Piece("b", 0, 3, 0)]
    assert partition.sharded_group_pieces(["a", "b"], [5, 3], 0, 2) == [
        Piece("a", 0, 3, 0),
        Piece("b", 0, 2, 3),
    ]
    assert partition.sharded_group_pieces(["a", "b"], [5, 3], 1, 2) == [
        Piece("a", 3, 5, 0),
        Piece("b", 2, 3, 3),
    ]
    assert partition.sharded_group_numel([5, 3], 2) == 5


def test_deepspeed_layout_per_writer():
    """One layout per DeepSpeed writer, chosen from the stage and the bf16 optimizer: what each
    saves of a group of 5 + 3 elements over 3 ranks (4 per rank at stages 1-2; chunks of 3 and 1
    at stage 3) and where."""
    layouts = [type(layout_for(s, False, 3)) for s in (1, 2, 3)]
    assert layouts == [Stage1Layout, Stage2Layout, Stage3Layout]
    assert type(layout_for(1, True, 3)) is Bf16OptimizerLayout and layout_for(1, True, 3).stage == 1
    group = FlatGroup(["a", "b"], [5, 3])
    # the ZeRO optimizer saves a partition without its trailing padding, the moments with it
    last = layout_for(1, False, 3).write_partition(group, 2)
    assert (last.pieces, last.numel, last.padding, last.moments) == ([], 0, 4, 4)
    # the bf16 optimizer saves every partition whole; the last rank records the group's padding
    bf16 = [layout_for(1, True, 3).write_partition(group, r) for r in range(3)]
    assert [(p.numel, p.padding, p.moments) for p in bf16] == [(4, 0, 4), (4, 0, 4), (4, 4, 4)]
    sharded = layout_for(3, False, 3).write_partition(group, 1)
    assert sharded.pieces == [Piece("a", 2, 4, 0), Piece("b", 1, 2, 2)]
    assert (sharded.numel, sharded.padding) == (3, 0)
    assert layout_for(2, False, 3).model_files() == ["mp_rank_00_model_states.pt"]
    assert layout_for(3, False, 2).model_files() == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
    ]
    # frozen parameters: stage 1 in the module state_dict only, stage 2 whole, stage 3 in chunks
    shapes = {"f": torch.Size([5])}
    whole = {"f": torch.arange(5.0)}.__getitem__
    assert layout_for(1, False, 3).frozen_records(shapes, whole, 0) == (None, None)
    assert torch.equal(
        layout_for(2, False, 3).frozen_records(shapes, whole, 1)[1]["f"], torch.arange(5.0)
    )
    assert torch.equal(
        layout_for(3, False, 3).frozen_records(shapes, whole, 2)[1]["f"], torch.tensor([4.0, 0.0])
    )
    assert layout_for(3, False, 2).splits_group([5, 3], 7)
    assert not layout_for(2, False, 2).splits_group([5, 3], 7)


def test_safetensors_export_keeps_tied_weights_once(runs, tmp_path):
    """One fp32 model.safetensors: the tied head stored once (recorded in the metadata), readable by the
    safetensors package, loading into the model with the checkpoint's masters."""
    safetensors = pytest.importorskip("safetensors.torch")
    targets, results, save_dir = runs(2)
    fixture = targets[0][0]
    path = str(tmp_path / "model.safetensors")
    assert export_safetensors(os.path.join(save_dir, fixture), path) == {
        "lm_head.weight": "wte.weight"
    }
    plain = safetensors.load_file(path)
    model = TiedLM()
    assert set(plain) == set(model.state_dict()) - {"lm_head.weight"}
    state = load_safetensors_state_dict(path)
    assert state["lm_head.weight"] is state["wte.weight"]
    model.load_state_dict(state)
    assert model.lm_head.weight is model.wte.weight
    masters = results[0]["at_load"]["master"]
    assert all(torch.equal(model.get_parameter(n).detach(), t) for n, t in masters.items())
    assert torch.equal(model.position_scale, plain["position_scale"])


def test_convert_command(runs, tmp_path, capsys):
    """zengine-convert's two ways out; a config DeepSpeed has no ZeRO layout for exits 1 naming the stage."""
    _, _, save_dir = runs(2)
    source = os.path.join(save_dir, "s2_bf16_w2")
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(config(3, "bf16", 2)))
    assert (
        convert.main(
            [
                "to-deepspeed",
                source,
                str(tmp_path / "ds"),
                "--world-size",
                "2",
                "--config",
                str(cfg),
            ]
        )
        == 0
    )
    assert sorted(os.listdir(tmp_path / "ds" / "global_step3")) == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
    ]
    assert (tmp_path / "ds" / "latest").read_text() == "global_step3"
    assert convert.main(["to-safetensors", source, str(tmp_path / "model.safetensors")]) == 0
    assert "lm_head.weight" in capsys.readouterr().out
    cfg.write_text(json.dumps(config(0, "fp32", 2)))
    assert (
        convert.main(
            [
                "to-deepspeed",
                source,
                str(tmp_path / "ds0"),
                "--world-size",
                "2",
                "--config",
                str(cfg),
            ]
        )
        == 1
    )
    assert "ZeRO stage 0" in capsys.readouterr().err


def test_deepspeed_checkpoint_to_safetensors(tmp_path):
    """A DeepSpeed checkpoint (stage 3: masters and frozen weights in per-rank chunks) straight to one
    safetensors file without DeepSpeed: DeepSpeed's recorded masters and frozen weights, the head tied once."""
    ref = reference("s3_bf16_w2")
    path = str(tmp_path / "model.safetensors")
    assert export_safetensors(os.path.join(FIXTURES, "s3_bf16_w2"), path) == {
        "lm_head.weight": "wte.weight"
    }
    model = TiedLM()
    model.load_state_dict(load_safetensors_state_dict(path))
    assert all(torch.equal(model.get_parameter(n).detach(), t) for n, t in ref["at_save"].items())
    assert all(
        torch.equal(model.get_parameter(n).detach(), t.float())
        for n, t in ref["frozen_at_save"].items()
    )


def test_fp16_export_keeps_dynamic_loss_scaling(runs, tmp_path):
    """DeepSpeed replaces its loss scaler with the file's: an fp16 export must carry a dynamic one, with the
    config's window, hysteresis and floor (a static scale would silently end dynamic scaling)."""
    _, _, save_dir = runs(2)
    cfg = config(2, "fp32", 2)
    cfg["fp16"] = {
        "enabled": True,
        "initial_scale_power": 12,
        "loss_scale_window": 50,
        "hysteresis": 3,
        "min_loss_scale": 0.5,
    }
    out = export_deepspeed_checkpoint(
        os.path.join(save_dir, "s3_fp32_w2"), str(tmp_path / "ds"), 2, cfg
    )
    saved = load_ds_file(os.path.join(out, "zero_pp_rank_1_mp_rank_00_optim_states.pt"))[
        "optimizer_state_dict"
    ]
    scaler = saved["loss_scaler"]
    assert (
        scaler.ds_class == "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
        and saved["dynamic_loss_scale"]
    )
    assert {
        k: scaler.get(k)
        for k in (
            "cur_scale",
            "scale_window",
            "delayed_shift",
            "cur_hysteresis",
            "min_scale",
            "cur_iter",
            "dynamic",
        )
    } == {
        "cur_scale": 4096.0,
        "scale_window": 50,
        "delayed_shift": 3,
        "cur_hysteresis": 3,
        "min_scale": 0.5,
        "cur_iter": 0,
        "dynamic": True,
    }
    if (
        importlib.util.find_spec("deepspeed") is not None
    ):  # DeepSpeed's own class comes back, with them
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

        real = torch.load(
            os.path.join(out, "zero_pp_rank_1_mp_rank_00_optim_states.pt"), weights_only=False
        )
        real = real["optimizer_state_dict"]["loss_scaler"]
        assert (
            isinstance(real, DynamicLossScaler)
            and real.loss_scale == 4096.0
            and real.scale_window == 50
        )


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed: run this file with the venv that make_fixtures.py describes",
)
def test_deepspeed_continues_from_zengine_export(runs, tmp_path):
    """DeepSpeed 0.19.8 loads zengine's export (other stages than the checkpoint it came from) and trains on as
    it trained on from its own checkpoint."""
    targets, results, save_dir = runs(2)
    chosen = {
        "s3_fp32_w2": 2,
        "s2_bf16_w2": 1,
    }  # DeepSpeed's stage for each; bf16 stage 1: its bf16 optimizer
    targets, zengine_runs = zip(*[(t, r) for t, r in zip(targets, results) if t[0] in chosen])
    exports = []
    for fixture, _, precision in targets:
        exports.append(
            (
                export_deepspeed_checkpoint(
                    os.path.join(save_dir, fixture),
                    str(tmp_path / f"ds-{fixture}"),
                    2,
                    config(chosen[fixture], precision, 2),
                ),
                chosen[fixture],
                precision,
            )
        )
    ran = _results(spawn(deepspeed_continue, 2, exports, env={"DS_ACCELERATOR": "cpu"})[0])
    for (fixture, _, precision), zen, ds in zip(targets, zengine_runs, ran):
        ref = reference(fixture)
        assert ds["steps"] == SAVED_AT, fixture
        assert _worst(ds["masters"], zen["at_load"]["master"]) == 0.0, fixture
        assert ds["losses"] == pytest.approx(
            ref["losses_after"], rel=TOLERANCE[precision]["loss"]
        ), fixture
