"""Demo models for examples, tests and benchmarks, and how fz3 shards them."""

from __future__ import annotations

from ..sharding.model import Params, ShardedModel, shard
from .gpt import GPT, post, pre


def shard_gpt(module: GPT, **kwargs) -> tuple[ShardedModel, Params]:
    """``fz3.shard`` for the demo GPT: its stack is ``blocks``."""
    return shard(module, layers="blocks", pre=pre, post=post, **kwargs)
