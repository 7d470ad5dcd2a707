"""A small GPT (pre-LN, causal attention through ``scaled_dot_product_attention``).

A plain ``nn.Module`` that knows nothing of fz3: ``GPT(cfg)(tokens, targets) -> loss``.
``pre``/``post`` below are the two functions fz3 needs to run it layer by layer (plain
functions of the module; ``fz3.models.shard_gpt`` passes them to ``fz3.shard``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 64
    dim: int = 64
    heads: int = 4
    layers: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie: bool = False  # tie the head to the token embedding


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads, self.dropout = cfg.heads, cfg.dropout
        # No qkv bias: the key bias's gradient is analytically zero (softmax is shift-invariant),
        # so it is pure rounding noise, which Adam then amplifies to lr-sized steps.
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.register_buffer("position_ids", torch.arange(cfg.seq), persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie:
            self.head.weight = self.tok.weight
        self.apply(_init)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) int64 -> (B, T, C)
        return self.drop(self.tok(tokens) + self.pos(self.position_ids[: tokens.shape[1]]))

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.loss(h, targets)


def _init(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


def pre(m: GPT, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return m.embed(batch[0])


def post(m: GPT, h: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return m.loss(h, batch[1])


def synthetic_batch(cfg: GPTConfig, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and next-token targets (B, T) int64, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()
