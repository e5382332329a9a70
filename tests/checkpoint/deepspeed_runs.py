"""Shared by the DeepSpeed migration fixtures (written with DeepSpeed 0.19.8) and their test: a tiny GPT-2-like
model, the one config both engines read, the batches and the training loop.

The same file runs under DeepSpeed (tests/fixtures/deepspeed/make_fixtures.py, in a venv that has it) and
under zengine (tests/checkpoint/test_deepspeed_migration.py): it imports neither.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, SEQ = 37, 13, 29, 5  # odd sizes: no world size divides a parameter or a group
LR, CLIP, GLOBAL_BATCH = 1e-2, 1.0, 6  # 6 rows split evenly over 1, 2 or 3 ranks
SAVED_AT, CONTINUED = 3, 3  # steps before the save, and after it


class TiedLM(nn.Module):
    """GPT-2's shape in miniature: a token embedding tied to the output head, a position embedding, a
    pre-norm MLP block, a frozen layer (not in the optimizer) and a persistent buffer. Every trained
    parameter gets a gradient every step (DeepSpeed steps a parameter without one, torch does not)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(SEQ, DIM)
        self.ln = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, HIDDEN)
        self.proj = nn.Linear(HIDDEN, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2
        self.register_buffer("position_scale", torch.linspace(0.5, 1.5, SEQ))

    def forward(self, x, y):
        tokens = self.wte(x)
        positions = self.wpe(torch.arange(x.shape[1], device=x.device))
        # in the compute dtype whatever an engine did with the fp32 buffer
        h = tokens + (positions * self.position_scale[: x.shape[1], None]).to(tokens.dtype)
        h = h + self.proj(F.gelu(self.fc(self.ln(h))))
        h = h + torch.tanh(self.frozen(h))
        logits = self.lm_head(h)
        return F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1))


def param_groups(model: nn.Module) -> list[dict]:
    """Two groups, as a GPT recipe makes them: matrices with weight decay, vectors without."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for _, p in trained if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for _, p in trained if p.dim() < 2], "weight_decay": 0.0},
    ]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer both engines train with: torch's AdamW on the two groups (DeepSpeed's FusedAdam
    needs its compiled ops; zengine's config AdamW computes what torch's does)."""
    return torch.optim.AdamW(param_groups(model), lr=LR, betas=(0.9, 0.999), eps=1e-8)


def config(stage: int, precision: str, world: int, aligned: bool = False) -> dict:
    """The DeepSpeed JSON config both engines read (same keys). ``aligned``: DeepSpeed's
    ``parameter_alignment`` (each parameter padded to 16 bytes in its flat group; DeepSpeed only)."""
    cfg = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": LR,
                "warmup_num_steps": 4,
                "warmup_type": "linear",
            },
        },
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 20},
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }
    if aligned:
        cfg["zero_optimization"]["parameter_alignment"] = True
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        if stage == 1:  # DeepSpeed's BF16_Optimizer (files named bf16_zero_pp_rank_*)
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def batches(steps: int, seed: int = 1234) -> list:
    """Deterministic token batches, each (x, y) of shape [GLOBAL_BATCH, SEQ]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        out.append((x, (x * 7 + 3) % VOCAB))
    return out


def train(engine, steps: list) -> list[float]:
    """One optimizer step per global batch (this rank's rows); the mean loss over ranks of each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = GLOBAL_BATCH // world
    losses = []
    for x, y in steps:
        loss = engine(x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses
