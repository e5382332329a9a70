"""A small decoder-only transformer (GPT) for examples and benchmarks.

Token and position embeddings, ``n_layer`` pre-LayerNorm blocks (causal
self-attention, then a 4x GELU MLP, each added back to the residual stream),
a final LayerNorm and an output head that shares its weight with the token
embedding. Sizes come from :class:`GPTConfig`; presets are plain functions.

The loss is computed inside the head module, not in ``GPT.forward``: under
ZeRO-3 ``engine.compile()`` compiles each gather unit alone (the fetch hooks
stay outside compiled code), so code between units runs eagerly; in the head
the cross-entropy is compiled with the projection it follows (torchtitan
compiles its loss for the same reason).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`."""

    vocab_size: int
    """Number of token ids; the embedding and the tied output head have this many rows."""
    seq_len: int
    """Longest sequence the model accepts (rows of the position table)."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``d_model``."""
    d_model: int
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout on embeddings, attention weights and block outputs (0 keeps runs deterministic)."""

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} is not divisible by n_head={self.n_head}"
            )
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig: {name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout}")

    def num_params(self) -> int:
        """Trainable parameters of a GPT of this shape (the tied head counted once)."""
        d = self.d_model
        block = (
            12 * d * d + 13 * d
        )  # qkv, attention out, MLP in/out weights and biases, two LayerNorms
        return self.vocab_size * d + self.seq_len * d + self.n_layer * block + 2 * d


def tiny() -> GPTConfig:
    """About 0.8M parameters over bytes: the main example trains it in a minute or two on two CPU ranks."""
    return GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=128)


def bench20m() -> GPTConfig:
    """About 21M parameters (4 layers, d_model 512, seq 128): the model of the step-time figures in MEASURED.md.

    The vocabulary (16384 tokens, tied head) holds 8.4M of the parameters, the
    four blocks 12.6M.
    """
    return GPTConfig(vocab_size=16384, seq_len=128, n_layer=4, n_head=8, d_model=512)


def bench100m() -> GPTConfig:
    """About 98M parameters (12 layers, d_model 768, seq 128; GPT-2 small's blocks over a 16384-token
    vocabulary): big enough that the ZeRO stages' memory differs by hundreds of MB on two ranks (the
    autotuning benchmark's model)."""
    return GPTConfig(vocab_size=16384, seq_len=128, n_layer=12, n_head=12, d_model=768)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees only itself and earlier positions."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        # [batch, seq, 3 * width] -> three of [batch, n_head, seq, head_dim]
        q, k, v = (
            t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.out(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    """Position-wise feed-forward layer: widen 4x, GELU, project back."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_attn(x)))
        return x + self.drop(self.mlp(self.ln_mlp(x)))


class LMHead(nn.Linear):
    """The output projection; given ``targets`` it returns the mean next-token cross-entropy (in fp32
    whatever the compute dtype) instead of the logits, so that one compiled module holds both."""

    project = nn.Linear.forward  # the product, by this name so that bf16.cpu_matmul can route it

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.project(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


class GPT(nn.Module):
    """Decoder-only language model; ``forward(idx, targets)`` gives the mean next-token loss."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_final = nn.LayerNorm(cfg.d_model)
        self.head = LMHead(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one matrix reads and writes tokens
        self._init_weights()

    def _init_weights(self) -> None:
        # Small normal weights; the two projections that write into the residual stream are scaled
        # down by the depth so the stream's variance does not grow with the number of blocks.
        # Under zero.Init the parameters are already partitioned (to NVMe, even): each is gathered whole for its
        # initialisation and rank 0's values are written back to every shard; elsewhere the context does nothing.
        from ..zero import GatheredParameters

        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            matrix = (
                len(getattr(p, "ds_shape", p.shape)) >= 2
            )  # a partitioned parameter shows an empty tensor
            if not matrix and not name.endswith("bias"):
                continue
            with GatheredParameters(p, modifier_rank=0), torch.no_grad():
                if not matrix:
                    nn.init.zeros_(p)
                else:
                    std = (
                        residual_std
                        if name.endswith(("attn.out.weight", "mlp.down.weight"))
                        else 0.02
                    )
                    nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` for ``idx`` ``[batch, seq]``; with ``targets``, the mean
        cross-entropy over every position instead (computed in fp32 whatever the compute dtype)."""
        seq = idx.shape[1]
        if seq > self.cfg.seq_len:
            raise ValueError(
                f"GPT: sequence of {seq} tokens is longer than seq_len={self.cfg.seq_len}"
            )
        positions = torch.arange(seq, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x), targets)
