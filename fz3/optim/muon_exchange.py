"""Muon's exchange (``owners.py`` plans it): U's slices to each matrix's owner, Newton-Schulz
there, O's slices back, in three stages with an all-to-all in flight between them, so a
caller may run other work while each travels (``fz3.train_step``: the backward of the units
below; ``muon``'s ``_per_unit``). ``exchange`` runs the three at once (``fz3.optim.step``).
"""

from __future__ import annotations

import torch

from ..comm.collectives import Comm, Pending, all_to_all, wait
from .newton_schulz import orthogonalize
from .owners import Exchange


class Exchanging:
    """One exchange under way. Made: ``u``'s slices (per stack part, (k, shard) fp32) packed
    in bf16 (NS's first step rounds to bf16: the same bits) and sent to their owners. The
    first ``advance`` waits for them, orthogonalizes what this rank owns (same-shape matrices
    as one batch) and sends the results back; the second waits for them and returns this
    rank's slices of O (1-D bf16, in ``ex.send`` order). Collective: each of the two
    all-to-alls over the model's gradient group, made and advanced in the same order on every
    rank (one that owns nothing, or holds nothing, sends and receives nothing)."""

    __slots__ = ("comm", "ex", "ns", "pending", "sent")

    def __init__(self, comm: Comm, ex: Exchange, u: dict[int, torch.Tensor], ns: dict):
        self.comm, self.ex, self.ns = comm, ex, ns
        device = next(iter(u.values())).device if u else torch.device("cpu")
        sent = torch.empty(sum(ex.send_sizes), dtype=torch.bfloat16, device=device)
        if ex.send:
            torch.cat([u[p.part][p.row, p.first:p.stop] for p in ex.send], out=sent)
        got = torch.empty(sum(ex.recv_sizes), dtype=torch.bfloat16, device=device)
        self.sent = sent  # (its size and device, for the second all-to-all's output)
        self.pending: Pending | None = all_to_all(
            comm, got, sent, list(ex.recv_sizes), list(ex.send_sizes),
            label="Muon: matrix slices to their owners")

    def advance(self) -> torch.Tensor | None:
        """The next stage: None after the first (the results on their way back), this rank's
        slices of O after the second. Collective (see the class)."""
        if self.sent is None:
            return wait(self.pending)
        ex, ns, got = self.ex, self.ns, wait(self.pending)
        owned = torch.empty(sum(n * a * b for (a, b), n in ex.groups), dtype=got.dtype,
                            device=got.device)
        if ex.runs:
            runs = torch.split(got, list(ex.runs))
            torch.cat([runs[i] for i in ex.assemble], out=owned)
        at = 0
        for (a, b), n in ex.groups:  # same-shape matrices as one batch
            batch = owned[at:at + n * a * b].view(n, a, b)
            batch.copy_(orthogonalize(batch, ns["coefficients"], ns["steps"], ns["eps"]))
            at += n * a * b
        if ex.back:
            torch.cat([owned[lo:hi] for lo, hi in ex.back], out=got)
        back, self.sent = torch.empty_like(self.sent), None
        self.pending = all_to_all(self.comm, back, got, list(ex.send_sizes),
                                  list(ex.recv_sizes), label="Muon: orthogonalized slices back")
        return None


def exchange(comm: Comm, ex: Exchange, u: dict[int, torch.Tensor], ns: dict) -> torch.Tensor:
    """``Exchanging``'s three stages at once: this rank's slices of O. Collective (two
    all-to-alls over the model's gradient group, on every rank)."""
    going = Exchanging(comm, ex, u, ns)
    going.advance()
    return going.advance()
