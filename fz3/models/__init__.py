"""Demo models for examples, tests and benchmarks, and how fz3 shards them."""

from __future__ import annotations

import torch

from ..cost.calibrate import Probe
from ..facade import shard
from ..sharding.model import Params, ShardedModel
from .gpt import GPT, Block, GPTConfig, post, pre, synthetic_batch


def shard_gpt(module: GPT, **kwargs) -> tuple[ShardedModel, Params]:
    """``fz3.shard`` for the demo GPT: its stack is ``blocks``."""
    return shard(module, layers="blocks", pre=pre, post=post, **kwargs)


def gpt_probe() -> Probe:
    """A demo-GPT ``fz3.cost.calibrate.Probe``: models too small for their FLOPs or bytes to
    matter, on which ``calibrate_cpu`` measures per-op and per-unit host overheads."""
    cfg = GPTConfig(vocab=16, seq=4, dim=8, heads=2, layers=8)
    g = torch.Generator().manual_seed(0)
    return Probe(block=Block(GPTConfig(dim=8, heads=2)),
                 block_input=torch.randn(1, 4, 8, generator=g),
                 shard=lambda group: shard_gpt(GPT(cfg), group=group),
                 batch=synthetic_batch(cfg, 1, seed=0))
