"""bf16 master weights against fp32 masters: loss curves of the main job's GPT (issue 42 item 2).

    python benchmarks/bench_bf16_masters.py [--steps 400] [--lr 5e-4] [--deepspeed /tmp/dsv/bin/python]
    python benchmarks/bench_bf16_masters.py --plot-only benchmarks/results/bf16_masters_<date>.json

One process trains the examples' GPT (``zengine.models.tiny``: 0.8M parameters over bytes of
zengine's own sources) from the same initial weights on the same batches, bf16 compute, ZeRO
stage 1, AdamW with decoupled weight decay, once per way of keeping the masters:

- ``fp32``: fp32 masters and moments (16 bytes of model state per parameter);
- ``nearest``: DeepSpeed's ``bf16_master_weights_and_grads`` + ``bf16_optimizer_states`` (8 bytes):
  an update under half a bf16 ulp of its weight is lost, so LayerNorm gains near 1.0 stop moving
  once ``lr`` is below 2^-9 and weight decay (``lr * wd`` relative) never applies;
- ``kahan``: the same, with a bf16 compensation buffer (10 bytes);
- ``stochastic``: the same, rounded stochastically (8 bytes).

With ``--deepspeed PYTHON`` (a venv with DeepSpeed), DeepSpeed 0.19.8's own bf16 masters and states
train the same model on the same batches in that interpreter, on the CPU accelerator, when it can.

It reports each run's training loss every step (smoothed for the plot), the held-out loss at the end,
and the gaps to fp32; the curves go to a JSON file, the table to a markdown file and the plot to a PNG
in ``benchmarks/results/`` (the PNG needs matplotlib: ``pip install zengine[benchmarks]``, or
``--plot-only`` run by any Python that has it). A loss comparison, not a timing: machine load does not
change the figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MODES = ("fp32", "nearest", "kahan", "stochastic")
REPO = Path(__file__).resolve().parents[1]


def batches(steps: int, micro: int, seq_len: int, held_out: int = 8):
    """The training batches and a fixed held-out set, the same for every run."""
    import torch

    from zengine.models import ByteWindows

    data = ByteWindows(seq_len)
    gen = torch.Generator().manual_seed(1234)
    order = torch.randperm(len(data), generator=gen)
    held, train = order[: held_out * micro], order[held_out * micro :]

    def stack(idx):
        xs, ys = zip(*(data[int(i)] for i in idx))
        return torch.stack(xs), torch.stack(ys)

    picks = torch.randint(0, len(train), (steps, micro), generator=gen)
    return [stack(train[p]) for p in picks], [
        stack(held[i * micro : (i + 1) * micro]) for i in range(held_out)
    ]


def zengine_config(mode: str, lr: float, micro: int) -> dict:
    bf16 = {"enabled": True}
    if mode != "fp32":
        bf16.update(
            bf16_master_weights_and_grads=True, bf16_optimizer_states=True, master_rounding=mode
        )
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 1.0,
        "bf16": bf16,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.1}},
        "steps_per_print": 10**9,
    }


def run_zengine(mode: str, steps: int, lr: float, micro: int) -> dict:
    """One run: the loss at every step and the held-out loss at the end."""
    import torch

    import zengine
    from zengine.models import GPT, tiny

    cfg = tiny()
    torch.manual_seed(0)
    model = GPT(cfg)
    engine, *_ = zengine.initialize(model=model, config=zengine_config(mode, lr, micro))
    train, held = batches(steps, micro, cfg.seq_len)
    losses = []
    for x, y in train:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        held_loss = sum(float(engine(x, y)) for x, y in held) / len(held)
    engine.destroy()
    return {"losses": losses, "held_out": held_loss}


DEEPSPEED_RUN = r"""
import json, os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, sys.argv[1])
import torch, deepspeed
sys.path.insert(0, sys.argv[1] + "/benchmarks")
from bench_bf16_masters import batches
from zengine.models import GPT, tiny
steps, lr, micro = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
cfg = tiny()
torch.manual_seed(0)
model = GPT(cfg)
config = {
    "train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0,
    "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
    "zero_optimization": {"stage": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.1, "torch_adam": True}},
    "steps_per_print": 10**9,
}
deepspeed.init_distributed(dist_backend="gloo")
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
train, held = batches(steps, micro, cfg.seq_len)
losses = []
for x, y in train:
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    losses.append(float(loss))
with torch.no_grad():
    held_loss = sum(float(engine(x, y)) for x, y in held) / len(held)
print("RESULT " + json.dumps({"losses": losses, "held_out": held_loss}))
"""


def run_deepspeed(python: str, steps: int, lr: float, micro: int) -> dict:
    """DeepSpeed's bf16 masters and states on the same run in ``python``; {"error": ...} when it
    cannot train here."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29561", "RANK": "0", "WORLD_SIZE": "1"}
    env.update(LOCAL_RANK="0", PATH="/usr/bin:/bin", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [python, "-c", DEEPSPEED_RUN, str(REPO), str(steps), str(lr), str(micro)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": " / ".join(tail)}


def smooth(values: list[float], window: int = 20) -> list[float]:
    """The running mean over the last ``window`` steps (a loss curve readable by eye)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def report(results: dict, args) -> str:
    """The markdown table: final losses and their gaps to fp32."""
    base = results["fp32"]
    tail = max(1, args.steps // 10)
    last = lambda r: sum(r["losses"][-tail:]) / tail  # noqa: E731 - the last tenth's mean
    # DeepSpeed keeps its bf16 master partition apart from the bf16 parameters: 2 bytes more
    bytes_per = {"fp32": 16, "nearest": 8, "kahan": 10, "stochastic": 8, "deepspeed": 10}
    lines = [
        f"# bf16 master weights against fp32 masters ({args.date})",
        "",
        f"`python benchmarks/bench_bf16_masters.py --steps {args.steps} --lr {args.lr} "
        f"--micro {args.micro}`: the examples' GPT (zengine.models.tiny, 0.8M parameters), one "
        "process, bf16 compute, ZeRO stage 1, AdamW (weight decay 0.1, clipping 1.0), the same "
        f"initial weights and {args.steps} batches of {args.micro} x 64 bytes for every run.",
        "",
        f"| masters | bytes/param | train loss, last {tail} steps | gap to fp32 | held-out loss "
        "| gap to fp32 |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | - | did not run: {r['error']} | | | |")
            continue
        lines.append(
            f"| {name} | {bytes_per.get(name, '')} | {last(r):.4f} | {last(r) - last(base):+.4f} "
            f"| {r['held_out']:.4f} | {r['held_out'] - base['held_out']:+.4f} |"
        )
    lines += ["", "Loss curves (running mean over 20 steps): `" + args.png_name + "`.", ""]
    return "\n".join(lines)


def plot(results: dict, png: Path) -> bool:
    """The smoothed loss curves side by side, and each one's gap to fp32; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    base = smooth(results["fp32"]["losses"])
    for name, r in results.items():
        if "error" in r:
            continue
        curve = smooth(r["losses"])
        top.plot(curve, label=name, linewidth=1.2)
        bottom.plot([a - b for a, b in zip(curve, base)], label=name, linewidth=1.2)
    top.set_ylabel("training loss (mean of 20 steps)")
    top.legend()
    top.set_title("GPT tiny, bf16 compute: fp32 masters vs bf16 masters by rounding")
    bottom.axhline(0.0, color="black", linewidth=0.6)
    bottom.set_ylabel("loss minus fp32 masters' loss")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return True


def run_parallel(runs: list[str], args) -> dict:
    """Each run in a process of its own (this script with ``--one``), all at once."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="bench_bf16_masters_"))
    common = ["--steps", str(args.steps), "--lr", str(args.lr), "--micro", str(args.micro)]
    if args.deepspeed:
        common += ["--deepspeed", args.deepspeed]
    procs = {
        mode: subprocess.Popen(
            [sys.executable, __file__, "--modes", mode, "--one", str(folder / f"{mode}.json")]
            + common,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for mode in runs
    }
    out = {}
    for mode, proc in procs.items():
        proc.wait()
        path = folder / f"{mode}.json"
        out[mode] = json.loads(path.read_text()) if path.exists() else {"error": "no result"}
    return out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--deepspeed", default=None, help="a Python with DeepSpeed installed")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    parser.add_argument("--plot-only", default=None, help="plot a JSON file this wrote, and exit")
    parser.add_argument(
        "--parallel",
        action="store_true",
        help="train the runs at once, one process each (a loss comparison: timing does not matter)",
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a --parallel worker's JSON
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        path = Path(args.plot_only)
        ok = plot(json.loads(path.read_text())["results"], path.with_suffix(".png"))
        print(path.with_suffix(".png") if ok else "matplotlib is not installed", file=sys.stderr)
        return 0 if ok else 1
    sys.path.insert(0, str(REPO / "benchmarks"))
    from common import result_path, today

    args.date = today()
    if args.one:
        mode = args.modes
        run = run_deepspeed if mode == "deepspeed" else run_zengine
        extra = (args.deepspeed,) if mode == "deepspeed" else (mode,)
        Path(args.one).write_text(json.dumps(run(*extra, args.steps, args.lr, args.micro)))
        return 0
    runs = args.modes.split(",") + (["deepspeed"] if args.deepspeed else [])
    results = run_parallel(runs, args) if args.parallel else {}
    for mode in runs:
        if mode not in results:
            results[mode] = (
                run_deepspeed(args.deepspeed, args.steps, args.lr, args.micro)
                if mode == "deepspeed"
                else run_zengine(mode, args.steps, args.lr, args.micro)
            )
        print(f"{mode}: held-out loss {results[mode].get('held_out')}", file=sys.stderr)
    md = result_path(args.out, "bf16_masters")
    png = md.with_suffix(".png")
    args.png_name = png.name
    md.with_suffix(".json").write_text(json.dumps({"args": vars(args), "results": results}))
    text = report(results, args)
    md.write_text(text)
    print(text)
    if not plot(results, png):
        print(
            f"no matplotlib: plot with `python {Path(__file__).name} --plot-only "
            f"{md.with_suffix('.json')}` in a Python that has it",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
