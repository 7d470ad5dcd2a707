"""A step reads no device value on the host (issue 26, item 3): run under a dispatch mode that
records every op that would (``aten._local_scalar_dense``, behind ``.item()``, ``bool()`` and
``float()``; ``nonzero``; ``is_nonzero``; ``equal``), a steady step records none. Off for this:
``check_sync`` (the batch check across ranks: on by default on the CPU only, off on GPUs),
``check_finite`` and loss scaling, each of which reads one flag by design. On the CPU a read is
no synchronisation, but the same op on a GPU is one: the mode sees the op, whatever the
device."""

from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dist
import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from reference import batches, gpt

READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
         torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}


class HostReads(TorchDispatchMode):
    """Records each op that reads a tensor's value on the host, with where it was called."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.seen.append(f"{func}:\n{''.join(traceback.format_stack(limit=8)[:-1])}")
        return func(*args, **(kwargs or {}))


def steps_ranks(rank, world):
    cfg = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=4, dropout=0.1)
    model, params = shard_gpt(gpt(cfg))
    b = batches(cfg, world)[rank]
    opt = fz3.optim.adamw(lr=1e-3)
    state = opt.init(params)
    policies = (fz3.Policy(), fz3.Policy(activations="save"),
                fz3.Policy(activations="selective"), fz3.Policy(layers_per_unit=2, prefetch=2))
    for policy in policies:
        for trace in (True, False):
            step = fz3.value_and_grad(model, policy, check_sync=False, trace=trace)
            step(params, b)  # the first step traces
            reads = HostReads()
            with reads:
                loss, grads = step(params, b)
            assert reads.seen == [], (str(policy), trace, reads.seen[0])
            # (outside: AdamW reads its step count, a CPU tensor by design, on every device)
            params, state = fz3.optim.step(opt, grads, state, params)
    # the mode sees what it should: a read on the host is recorded
    reads = HostReads()
    with reads:
        float(loss)
    assert len(reads.seen) == 1
    return "ok"


def test_a_steady_step_reads_nothing_on_the_host():
    assert dist.run(2, steps_ranks, timeout=300) == ["ok"] * 2
