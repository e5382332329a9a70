"""Monitoring (DeepSpeed's tensorboard / csv_monitor / wandb sections) and wall_clock_breakdown timers."""

import csv
import logging
import sys
import time
import types
import warnings

import pytest
import torch

from harness import spawn
from zengine.config import ConfigError, load_config
from zengine.monitor import (
    CsvMonitor,
    MonitorDependencyError,
    MonitorMaster,
    NullMonitor,
    StepReport,
    TensorBoardMonitor,
    WandbMonitor,
    build_monitor,
)
from zengine.monitor import events as ev
from zengine.monitor.timers import BACKWARD, FORWARD, STEP, Timers, WallClockTimer, format_breakdown

BASE = {"train_micro_batch_size_per_gpu": 1}


def _read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.reader(handle))


class Recorder:
    """A monitor that keeps what it is given."""

    def __init__(self, enabled=True):
        self.enabled, self.events, self.closed = enabled, [], False

    def write_events(self, events):
        self.events.extend(events)

    def close(self):
        self.closed = True


# -- csv monitor ---------------------------------------------------------------------------------------


def test_csv_monitor_writes_one_file_per_event_with_step_and_value(tmp_path):
    monitor = CsvMonitor(str(tmp_path), "job")
    monitor.write_events([("Train/Samples/train_loss", 2.5, 8), ("Train/Samples/lr", 0.001, 8)])
    monitor.write_events([("Train/Samples/train_loss", 1.25, 16), ("my metric", 3.0, 16)])
    files = sorted(p.name for p in (tmp_path / "job").iterdir())
    assert files == ["Train_Samples_lr.csv", "Train_Samples_train_loss.csv", "my_metric.csv"]
    assert _read_csv(tmp_path / "job" / "Train_Samples_train_loss.csv") == [
        ["step", "train_loss"],
        ["8", "2.5"],
        ["16", "1.25"],
    ]
    assert _read_csv(tmp_path / "job" / "Train_Samples_lr.csv") == [["step", "lr"], ["8", "0.001"]]
    assert _read_csv(tmp_path / "job" / "my_metric.csv") == [["step", "my metric"], ["16", "3.0"]]


def test_csv_monitor_resumed_run_appends_without_a_second_header(tmp_path):
    CsvMonitor(str(tmp_path), "job").write_events([("Train/Samples/lr", 0.5, 1)])
    CsvMonitor(str(tmp_path), "job").write_events([("Train/Samples/lr", 0.25, 2)])
    assert _read_csv(tmp_path / "job" / "Train_Samples_lr.csv") == [
        ["step", "lr"],
        ["1", "0.5"],
        ["2", "0.25"],
    ]


def test_csv_monitor_empty_output_path_is_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monitor = CsvMonitor("", "DeepSpeedJobName")
    monitor.write_events([("a/b", 1.0, 0)])
    assert (tmp_path / "DeepSpeedJobName" / "a_b.csv").exists()
    monitor.close()
    monitor.write_events([("a/b", 2.0, 1)])  # dropped after close
    assert len(_read_csv(tmp_path / "DeepSpeedJobName" / "a_b.csv")) == 2


# -- tensorboard / wandb sinks with stand-in modules (neither package is required) ------------------


def test_tensorboard_monitor_writes_scalars_and_flushes(tmp_path, monkeypatch):
    calls = []

    class SummaryWriter:
        def __init__(self, log_dir):
            calls.append(("init", log_dir))

        def add_scalar(self, name, value, step):
            calls.append(("scalar", name, value, step))

        def flush(self):
            calls.append(("flush",))

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(
        sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter)
    )
    monitor = TensorBoardMonitor(str(tmp_path), "tb")
    monitor.write_events([("Train/Samples/lr", 0.1, 4), ("Train/Samples/train_loss", 2.0, 4)])
    monitor.close()
    monitor.close()
    assert calls == [
        ("init", str(tmp_path / "tb")),
        ("scalar", "Train/Samples/lr", 0.1, 4),
        ("scalar", "Train/Samples/train_loss", 2.0, 4),
        ("flush",),
        ("close",),
    ]


def test_wandb_monitor_logs_one_dict_per_step(monkeypatch):
    calls = []
    fake = types.SimpleNamespace(
        init=lambda **kw: calls.append(("init", kw)),
        log=lambda values, step: calls.append(("log", values, step)),
        finish=lambda: calls.append(("finish",)),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monitor = WandbMonitor(project="p", group="g", team="t")
    monitor.write_events([("a", 1.0, 8), ("b", 2.0, 8), ("a", 3.0, 16)])
    monitor.close()
    assert calls == [
        ("init", {"project": "p", "group": "g", "entity": "t"}),
        ("log", {"a": 1.0, "b": 2.0}, 8),
        ("log", {"a": 3.0}, 16),
        ("finish",),
    ]


# -- build_monitor -------------------------------------------------------------------------------------


def _cfg(**sections):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config({**BASE, **sections}, 1)


def test_nothing_enabled_gives_a_null_monitor():
    monitor = build_monitor(_cfg(), 0)
    assert isinstance(monitor, NullMonitor) and not monitor.enabled
    monitor.write_events([("x", 1.0, 1)])
    monitor.close()


def test_csv_monitor_on_rank_0_only(tmp_path):
    cfg = _cfg(csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "j"})
    on_zero, on_one = build_monitor(cfg, 0), build_monitor(cfg, 1)
    assert isinstance(on_zero, MonitorMaster) and on_zero.enabled
    assert isinstance(on_one, NullMonitor) and not on_one.enabled
    on_zero.write_events([("Train/Samples/lr", 0.5, 2)])
    on_zero.close()
    assert _read_csv(tmp_path / "j" / "Train_Samples_lr.csv") == [["step", "lr"], ["2", "0.5"]]


@pytest.mark.parametrize(
    "section, module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")]
)
@pytest.mark.parametrize("rank", [0, 1])
def test_missing_package_is_a_clear_error_on_every_rank(section, module, rank, monkeypatch):
    monkeypatch.setitem(
        sys.modules, module, None
    )  # makes the import fail whether or not it is installed
    cfg = _cfg(**{section: {"enabled": True}})
    with pytest.raises(MonitorDependencyError) as error:
        build_monitor(cfg, rank)
    message = str(error.value)
    assert f"pip install {section}" in message and f'"{section}": {{"enabled": false}}' in message
    assert isinstance(error.value, ImportError)


def test_missing_package_of_a_disabled_section_is_not_needed(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert isinstance(
        build_monitor(_cfg(tensorboard={"enabled": False}, wandb={"enabled": False}), 0),
        NullMonitor,
    )


def test_monitor_master_closes_every_sink_even_if_one_fails():
    class Broken(Recorder):
        def close(self):
            raise OSError("disk gone")

    good = Recorder()
    master = MonitorMaster([Broken(), good])
    master.write_events([("a", 1.0, 1)])
    with pytest.raises(OSError, match="disk gone"):
        master.close()
    assert good.closed and good.events == [("a", 1.0, 1)] and not master.enabled


# -- config --------------------------------------------------------------------------------------------


def test_sections_parse_with_deepspeed_defaults():
    cfg = _cfg()
    assert (cfg.tensorboard.enabled, cfg.tensorboard.output_path, cfg.tensorboard.job_name) == (
        False,
        "",
        "DeepSpeedJobName",
    )
    assert (cfg.csv_monitor.enabled, cfg.csv_monitor.output_path, cfg.csv_monitor.job_name) == (
        False,
        "",
        "DeepSpeedJobName",
    )
    assert (cfg.wandb.enabled, cfg.wandb.group, cfg.wandb.team, cfg.wandb.project) == (
        False,
        None,
        None,
        "deepspeed",
    )
    cfg = _cfg(
        tensorboard={"enabled": True, "output_path": "out/", "job_name": "bert"},
        csv_monitor={"enabled": True, "output_path": "csv/", "job_name": "run1"},
        wandb={"enabled": True, "group": "g", "team": "t", "project": "p"},
        wall_clock_breakdown=True,
    )
    assert (cfg.tensorboard.output_path, cfg.tensorboard.job_name, cfg.csv_monitor.job_name) == (
        "out/",
        "bert",
        "run1",
    )
    assert (cfg.wandb.group, cfg.wandb.team, cfg.wandb.project, cfg.wall_clock_breakdown) == (
        "g",
        "t",
        "p",
        True,
    )


def test_sections_are_no_longer_ignored_keys():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ConfigWarning "accepts but ignores"
        cfg = load_config(
            {**BASE, "tensorboard": {"enabled": False}, "csv_monitor": {}, "wandb": None}, 1
        )
    assert cfg.ignored_keys == ()


@pytest.mark.parametrize(
    "sections, message",
    [
        (
            {"csv_monitor": {"enabled": True, "ouput_path": "x"}},
            "csv_monitor.ouput_path: unknown key; did you mean 'output_path'?",
        ),
        (
            {"tensorboard": {"enabeld": True}},
            "tensorboard.enabeld: unknown key; did you mean 'enabled'?",
        ),
        (
            {"wandb": {"enabled": True, "teams": "x"}},
            "wandb.teams: unknown key; did you mean 'team'?",
        ),
        ({"csv_monitr": {"enabled": True}}, "csv_monitr: unknown key; did you mean 'csv_monitor'?"),
        ({"tensorboard": {"enabled": "yes"}}, "tensorboard.enabled:"),
        ({"wandb": {"project": 3}}, "wandb.project:"),
        ({"csv_monitor": True}, "csv_monitor:"),
    ],
)
def test_typos_and_wrong_types_are_refused(sections, message):
    with pytest.raises(ConfigError) as error:
        load_config({**BASE, **sections}, 1)
    assert message in str(error.value)


# -- timers --------------------------------------------------------------------------------------------


def test_timer_adds_up_intervals_in_milliseconds_and_resets():
    timer = WallClockTimer("t")
    for _ in range(2):
        timer.start()
        time.sleep(0.02)
        timer.stop()
    timer.stop()  # stopping a stopped timer changes nothing
    first = timer.elapsed(reset=False)
    assert 35 <= first < 1000
    assert timer.elapsed() == first and timer.elapsed() == 0.0


def test_timers_time_with_blocks_even_when_they_raise():
    timers = Timers()
    with timers(FORWARD):
        time.sleep(0.01)
    with pytest.raises(RuntimeError):
        with timers(BACKWARD):
            time.sleep(0.01)
            raise RuntimeError("boom")
    assert not timers(BACKWARD).running
    elapsed = timers.elapsed_ms([FORWARD, BACKWARD, STEP])
    assert list(elapsed) == [FORWARD, BACKWARD]  # step never ran: left out
    assert all(5 <= ms < 1000 for ms in elapsed.values())
    assert timers.elapsed_ms([FORWARD, BACKWARD]) == {FORWARD: 0.0, BACKWARD: 0.0}


def test_synchronize_runs_at_start_and_stop_only_when_enabled():
    syncs = []
    timers = Timers(True, lambda: syncs.append(1))
    with timers(STEP):
        pass
    assert len(syncs) == 2
    off = Timers(False, lambda: syncs.append(1))
    with off(STEP):
        pass
    off(FORWARD).start()
    off(FORWARD).stop()
    assert len(syncs) == 2 and off.elapsed_ms([STEP, FORWARD]) == {}


def test_for_device_synchronizes_a_gpu_only_when_enabled():
    assert Timers.for_device(True, torch.device("cpu"))._synchronize is None
    assert Timers.for_device(False, torch.device("cuda", 0))._synchronize is None
    assert Timers.for_device(True, torch.device("cuda", 0))._synchronize is not None


def test_breakdown_line_in_deepspeeds_layout():
    assert (
        format_breakdown({FORWARD: 12.345, BACKWARD: 20.0, STEP: 3.4})
        == "time (ms) | fwd: 12.35 | bwd: 20.00 | step: 3.40"
    )


# -- the report an engine makes ------------------------------------------------------------------------


class FakeEngine:
    """What StepReport reads from an engine."""

    def __init__(self, rank=0):
        self.global_steps, self.global_samples, self.global_rank = 0, 0, rank
        self.device, self.loss_scale, self.lr, self.norm = torch.device("cpu"), 1024.0, 0.01, 0.5

    def get_lr(self):
        return [self.lr, self.lr * 2]

    def get_global_grad_norm(self):
        return self.norm

    def train(self, step_report, losses, gas, batch):
        """One optimizer step of ``gas`` micro batches with these losses."""
        for m, loss in enumerate(losses):
            step_report.record_loss(torch.tensor(loss), boundary=m == gas - 1)
        self.global_steps += 1
        self.global_samples += batch


def _by_name(events):
    return {name: (value, x) for name, value, x in events}


def test_report_events_have_deepspeeds_names_and_the_window_mean_loss():
    monitor, engine = Recorder(), FakeEngine()
    report = StepReport(monitor, Timers(False), fp16=True)
    engine.train(report, [1.0, 3.0], gas=2, batch=8)
    engine.train(report, [4.0, 6.0], gas=2, batch=8)
    events = report.report(engine)
    assert events == monitor.events
    assert {x for _, _, x in events} == {16}  # x: samples trained so far
    got = _by_name(events)
    assert got[ev.TRAIN_LOSS] == (5.0, 16)  # the last accumulation window's mean
    assert got[ev.LR] == (0.01, 16)  # the first param group's, as in DeepSpeed
    assert got[ev.LOSS_SCALE] == (1024.0, 16)
    assert got[ev.GRAD_NORM] == (0.5, 16)
    assert got[ev.SAMPLES_PER_SEC][0] > 0 and got[ev.HOST_RSS_GB][0] > 0
    assert ev.TRAIN_LOSS == "Train/Samples/train_loss" and ev.LR == "Train/Samples/lr"
    assert ev.LOSS_SCALE == "Train/Samples/loss_scale"
    assert not any("elapsed_time" in name for name in got)  # no wall_clock_breakdown


def test_report_without_fp16_norm_or_loss_leaves_them_out():
    monitor, engine = Recorder(), FakeEngine()
    engine.norm = None
    report = StepReport(monitor, Timers(False), fp16=False)
    engine.global_samples = 4
    names = {name for name, _, _ in report.report(engine)}
    assert ev.LOSS_SCALE not in names and ev.GRAD_NORM not in names and ev.TRAIN_LOSS not in names
    assert ev.LR in names
    engine.train(report, [2.0], gas=1, batch=4)
    assert _by_name(report.report(engine))[ev.TRAIN_LOSS] == (2.0, 8)
    assert ev.TRAIN_LOSS not in _by_name(report.report(engine))  # no new loss since: none written


def test_report_on_another_rank_writes_nothing_and_keeps_no_loss():
    monitor, engine = Recorder(enabled=False), FakeEngine(rank=1)
    report = StepReport(monitor, Timers(False))
    engine.train(report, [1.0], gas=1, batch=4)
    assert report._last_loss is None
    assert report.report(engine) == [] and monitor.events == []


def test_breakdown_is_logged_and_written_at_a_report():
    monitor, engine = Recorder(), FakeEngine()
    timers = Timers(True)
    report = StepReport(monitor, timers)
    for name in (FORWARD, BACKWARD, STEP):
        with timers(name):
            time.sleep(0.005)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("zengine")
    log.addHandler(handler)
    previous = log.level
    log.setLevel(logging.INFO)
    try:
        engine.global_samples = 4
        got = _by_name(report.report(engine))
    finally:
        log.removeHandler(handler)
        log.setLevel(previous)
    for event in ev.ELAPSED.values():
        assert got[event][0] >= 4.0
    assert ev.ELAPSED == {
        FORWARD: "Train/Samples/elapsed_time_ms_forward",
        BACKWARD: "Train/Samples/elapsed_time_ms_backward",
        STEP: "Train/Samples/elapsed_time_ms_step",
    }
    breakdown = [line for line in lines if line.startswith("time (ms) | fwd: ")]
    assert len(breakdown) == 1 and " | bwd: " in breakdown[0] and " | step: " in breakdown[0]
    assert timers.elapsed_ms([FORWARD]) == {FORWARD: 0.0}  # read and reset by the report


def test_breakdown_resets_on_other_ranks_too():
    timers = Timers(True)
    report = StepReport(Recorder(enabled=False), timers)
    with timers(FORWARD):
        time.sleep(0.002)
    assert report.report(FakeEngine(rank=1)) == []
    assert timers.elapsed_ms([FORWARD]) == {FORWARD: 0.0}


def test_close_closes_the_monitor():
    monitor = Recorder()
    StepReport(monitor, Timers(False)).close()
    assert monitor.closed


# -- the engine, end to end (build_monitor / Timers / StepReport wired in engine/engine.py) ---


def _train_with_csv_monitor(out_dir):
    import torch.distributed as dist
    from torch import nn

    import zengine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": 0.01,
                "warmup_num_steps": 8,
                "warmup_type": "linear",
            },
        },
        "wall_clock_breakdown": True,
        "zero_optimization": {"stage": 2},
        "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "job"},
    }
    engine, _, _, _ = zengine.initialize(model=model, config=config)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)
    window_loss, lr_after, samples_after = {}, {}, {}
    for step in range(1, 5):
        losses = []
        for _ in range(2):
            x = torch.randn(2, 4, generator=g)
            loss = (engine(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        window_loss[step] = sum(losses) / 2
        lr_after[step] = engine.get_lr()[0]
        samples_after[step] = engine.global_samples
    enabled = engine.monitor.enabled
    engine.destroy()
    return rank, enabled, window_loss, lr_after, samples_after


def test_engine_writes_csv_rows_on_rank_0_at_steps_per_print(tmp_path):
    # Runs once the engine is wired (see the monitor report): until then engine.monitor does not exist.
    results = spawn(_train_with_csv_monitor, 2, str(tmp_path))
    (rank0, enabled0, loss, lr, samples), (rank1, enabled1, _, _, _) = results
    assert (rank0, enabled0, rank1, enabled1) == (0, True, 1, False)
    job = tmp_path / "job"
    loss_rows = _read_csv(job / "Train_Samples_train_loss.csv")
    lr_rows = _read_csv(job / "Train_Samples_lr.csv")
    # One row per optimizer step, as in DeepSpeed (written at the reports of steps 2 and 4), so rank 1
    # wrote nothing; x is the samples trained so far.
    steps = [1, 2, 3, 4]
    assert (
        [row[0] for row in loss_rows]
        == ["step"] + [str(samples[s]) for s in steps]
        == [row[0] for row in lr_rows]
    )
    assert (samples[2], samples[4]) == (16, 32)
    assert loss_rows[0] == ["step", "train_loss"] and lr_rows[0] == ["step", "lr"]
    assert [float(row[1]) for row in loss_rows[1:]] == pytest.approx(
        [loss[s] for s in steps], rel=1e-6
    )
    assert [float(row[1]) for row in lr_rows[1:]] == pytest.approx(
        [lr[s] for s in steps], rel=1e-12
    )
    grad_rows = _read_csv(job / "Train_Samples_global_grad_norm.csv")
    assert [row[0] for row in grad_rows] == ["step", str(samples[2]), str(samples[4])]  # per report
    assert lr[2] != lr[4]
    names = {p.name for p in job.iterdir()}
    for name in (
        "global_grad_norm",
        "samples_per_sec",
        "host_rss_gb",
        "elapsed_time_ms_forward",
        "elapsed_time_ms_backward",
        "elapsed_time_ms_step",
    ):
        assert f"Train_Samples_{name}.csv" in names
    assert "Train_Samples_loss_scale.csv" not in names  # fp32: no loss scale, as in DeepSpeed


def _initialize_with_tensorboard_missing():
    import torch.distributed as dist
    from torch import nn

    import zengine

    sys.modules["torch.utils.tensorboard"] = (
        None  # as if the tensorboard package were not installed
    )
    try:
        zengine.initialize(
            model=nn.Linear(2, 2),
            config={
                "train_micro_batch_size_per_gpu": 1,
                "optimizer": {"type": "AdamW", "params": {}},
                "tensorboard": {"enabled": True},
            },
        )
    except MonitorDependencyError as error:
        return dist.get_rank(), str(error)
    return dist.get_rank(), None


def test_initialize_fails_on_every_rank_when_tensorboard_is_missing():
    # Runs once the engine is wired (build_monitor in Engine.__init__).
    for rank, message in spawn(_initialize_with_tensorboard_missing, 2):
        assert message is not None and "pip install tensorboard" in message, rank
