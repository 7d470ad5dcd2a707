"""A model's stack matrices, and ``Rest``: a tree of every other trained element.

A *stack matrix* is a parameter of a layer stack's layers with two dimensions or more (a 3-D
one holds a matrix per leading index: stacked MoE experts); ``fz3.optim.muon`` orthogonalizes
them. Everything else (the parts outside stacks whole, and the stacks' vectors: norms, biases)
goes to another transformation, which sees it as a ``Rest``: per part, this rank's shard of the
part's elements outside its matrices. A part outside stacks is its ``(shard,)`` tensor itself;
a stack part's ``(k, shard)`` shard keeps its columns outside matrices, in order, as ``(k, c)``
(``c`` differs by rank). So that transformation's state (AdamW's two moments) takes no memory
for the matrices' elements.

``fz3.save`` writes a ``Rest`` as the ``Params`` it is part of (zeros on the matrices'
columns) and ``fz3.load`` reads it back compacted: it reshards like ``Params``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..schedule.structure import Role
from .layout import Slot
from .params import Params
from .parts import Part


class Rest(NamedTuple):
    """This rank's shards of the trained elements outside stack matrices, one tensor per part
    of the model (``model.parts``, in order): ``(shard,)`` outside stacks, ``(k, c)`` for a
    stack part (its columns outside matrices, ``rest_columns``). An optree pytree."""

    parts: tuple[torch.Tensor, ...]


def is_matrix(part: Part, slot: Slot) -> bool:
    """Whether ``slot`` of ``part`` is a stack matrix (2-D or more, inside a layer stack)."""
    return part.role is Role.STACK and len(slot.shape) >= 2


def matrix_runs(part: Part, rank: int) -> list[tuple[int, int]]:
    """``(first, stop)`` column ranges of rank ``rank``'s shard of ``part`` that hold stack
    matrices, adjacent ones merged (the same for every row of a stack)."""
    runs: list[tuple[int, int]] = []
    for slot, _, cols in part.layout.local_pieces(rank):
        if not is_matrix(part, slot):
            continue
        if runs and runs[-1][1] == cols.start:
            runs[-1] = (runs[-1][0], cols.stop)
        else:
            runs.append((cols.start, cols.stop))
    return runs


def rest_columns(part: Part, rank: int, device: Any) -> torch.Tensor | None:
    """The columns of rank ``rank``'s shard of a stack part outside its matrices (int64, in
    order; padding excluded); None for a part outside stacks (all of it is rest)."""
    if part.role is not Role.STACK:
        return None
    cols = [torch.arange(c.start, c.stop) for s, _, c in part.layout.local_pieces(rank)
            if not is_matrix(part, s)]
    return (torch.cat(cols) if cols else torch.zeros(0, dtype=torch.int64)).to(device)


def rest_of(model: Any, tree: Params, columns: list[torch.Tensor | None] | None = None) -> Rest:
    """The ``Rest`` of a tree shaped like the params (or broadcasting like a weight-decay mask:
    a stack's ``(1, shard)`` row): parts outside stacks as they are (no copy), stack parts'
    columns outside matrices (a copy). ``columns``: ``rest_columns`` of each part, if known."""
    if columns is None:
        columns = [rest_columns(p, model.rank, model.device) for p in model.parts]
    return Rest(tuple(t if c is None else t.index_select(t.dim() - 1, c)
                      for t, c in zip(tree.parts, columns)))


def expand(model: Any, rest: Rest) -> Params:
    """The ``Params``-shaped tree ``rest`` is part of: stack parts ``(k, shard)`` with zeros on
    the matrices' columns (and the padding); parts outside stacks as they are."""
    out = []
    for part, t in zip(model.parts, rest.parts):
        cols = rest_columns(part, model.rank, t.device)
        if cols is None:
            out.append(t)
            continue
        full = t.new_zeros(t.shape[0], part.layout.shard_numel)
        out.append(full.index_copy_(1, cols, t))
    return Params(tuple(out))
