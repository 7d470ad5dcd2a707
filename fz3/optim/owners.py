"""Which rank orthogonalizes each stack matrix, and which slices of the flat shards travel
where: plain data, computed once from the parts' layouts, the same on every rank.

Newton-Schulz needs each matrix whole, and a ZeRO-3 shard holds slices of it. The owner
pattern (microsoft/dion's distributed Muon, torchtitan's ``DistMuon``): every matrix has one
owner rank; one all-to-all sends each holder's slice of it to its owner, the owner
orthogonalizes all its matrices of one shape as one batch, and a second all-to-all sends the
slices of the result back. fz3's flat layout knows each matrix's element range, so the slices
(``Piece``) and the order they travel in (``Exchange``) are known before the first step.

Owners: matrices by Newton-Schulz cost, largest first (list scheduling, Graham 1969), each to
the rank holding most of it when that rank's load stays within the mean (its slice then
does not travel), else to the least loaded rank. Either way no rank's load exceeds the mean
by more than one matrix.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from ..sharding.matrices import is_matrix
from ..sharding.parts import Part
from .newton_schulz import flops


class Matrix(NamedTuple):
    name: str  # "blocks.3.attn.qkv.weight", "blocks.0.experts.w1[2]" for expert 2
    part: int  # index in model.parts
    row: int  # layer of the stack part
    start: int  # its first element in the row's flat layout
    shape: tuple[int, int]


class Piece(NamedTuple):
    """A matrix's slice in one rank's shard: columns ``[first, stop)`` of row ``row`` of the
    part's ``(k, shard)`` tensor, elements ``[offset, offset + stop - first)`` of the matrix."""

    matrix: int  # index in Plan.matrices
    part: int
    row: int
    first: int
    stop: int
    offset: int


class Exchange(NamedTuple):
    """One rank's side of the two all-to-alls. First: it sends ``send`` (its pieces, by owner
    then matrix) and receives, as an owner, runs of ``runs`` elements (by holder, then
    matrix); ``assemble`` orders them into its owned buffer (``groups`` back to back, each
    ``count`` matrices of ``shape``). Second: it sends each received run back from its span in
    the owned buffer (``back``) and receives its own pieces, in ``send`` order."""

    send: tuple[Piece, ...]
    send_sizes: tuple[int, ...]  # elements to each owner (first), from each owner (second)
    recv_sizes: tuple[int, ...]  # elements from each holder (first), to each holder (second)
    runs: tuple[int, ...]
    assemble: tuple[int, ...]
    back: tuple[tuple[int, int], ...]
    groups: tuple[tuple[tuple[int, int], int], ...]


class Plan(NamedTuple):
    matrices: tuple[Matrix, ...]
    owners: tuple[int, ...]  # per matrix
    flops: tuple[int, ...]  # per rank: Newton-Schulz FLOPs of a step
    pieces: tuple[dict[int, Piece], ...]  # per matrix: {holder rank: its slice}

    def exchange(self, rank: int) -> Exchange:
        """Rank ``rank``'s side of both all-to-alls (each rank computes only its own)."""
        return _exchange(rank, self.matrices, self.owners, self.pieces, len(self.flops))

    def only(self, part: int, layers: slice) -> Plan:
        """The matrices of layers ``layers`` of ``part``, with the owners this plan gave them
        (balanced over the whole model, so a step's loads stay this plan's ``flops``), their
        rows counted from the first: one unit's exchange (its update, ``fz3.train_step``).
        ``flops`` stays the whole model's."""
        keep = [k for k, m in enumerate(self.matrices)
                if m.part == part and layers.start <= m.row < layers.stop]
        index = {k: j for j, k in enumerate(keep)}
        first = layers.start
        return Plan(tuple(self.matrices[k]._replace(row=self.matrices[k].row - first)
                          for k in keep),
                    tuple(self.owners[k] for k in keep), self.flops,
                    tuple({r: p._replace(matrix=index[k], row=p.row - first)
                           for r, p in self.pieces[k].items()} for k in keep))


def stack_matrices(parts: Sequence[Part]) -> tuple[Matrix, ...]:
    """Every stack matrix in model order (part, row, slot, expert); 3-D slots give one matrix
    per leading index. The slots' dimensions were checked by the caller."""
    out = []
    for i, part in enumerate(parts):
        for row in range(part.rows):
            for s in part.layout.slots:
                if not is_matrix(part, s):
                    continue
                shape = tuple(s.shape[-2:])
                size = shape[0] * shape[1]
                name = part.prefix(row) + s.name
                experts = s.shape[0] if len(s.shape) == 3 else None
                for e in range(experts or 1):
                    out.append(Matrix(name if experts is None else f"{name}[{e}]", i, row,
                                      s.offset + e * size, shape))
    return tuple(out)


def plan(parts: Sequence[Part], world: int, steps: int) -> Plan:
    """The matrices, their owners and slices for ``parts`` sharded over ``world`` ranks
    (``steps``: Newton-Schulz iterations, for the costs)."""
    matrices = stack_matrices(parts)
    pieces = [_pieces(parts[m.part], m, k, world) for k, m in enumerate(matrices)]
    cost = [flops(m.shape, steps) for m in matrices]
    owners = _owners(cost, pieces, world)
    load = [0] * world
    for m, r in enumerate(owners):
        load[r] += cost[m]
    return Plan(matrices, tuple(owners), tuple(load), tuple(pieces))


def _pieces(part: Part, m: Matrix, index: int, world: int) -> dict[int, Piece]:
    """``{holder rank: its Piece}`` of matrix ``m`` (number ``index``)."""
    shard = part.layout.shard_numel
    size = m.shape[0] * m.shape[1]
    out = {}
    for r in range(m.start // shard, (m.start + size - 1) // shard + 1):
        lo, hi = max(m.start, r * shard), min(m.start + size, (r + 1) * shard)
        out[r] = Piece(index, m.part, m.row, lo - r * shard, hi - r * shard, lo - m.start)
    return out


def _owners(cost: list[int], pieces: list[dict[int, Piece]], world: int) -> list[int]:
    """Largest cost first; to the biggest holder if it stays within the mean load, else to the
    least loaded rank (lowest rank on ties): max load <= mean + the largest cost."""
    mean = sum(cost) / world
    load = [0] * world
    owners = [0] * len(cost)
    for m in sorted(range(len(cost)), key=lambda m: (-cost[m], m)):
        r = max(pieces[m], key=lambda h: (pieces[m][h].stop - pieces[m][h].first, -h))
        if load[r] + cost[m] > mean:
            r = min(range(world), key=lambda q: (load[q], q))
        owners[m] = r
        load[r] += cost[m]
    return owners


def _exchange(rank: int, matrices: tuple[Matrix, ...], owners: Sequence[int],
              pieces: Sequence[dict[int, Piece]], world: int) -> Exchange:
    """Rank ``rank``'s side of both exchanges (see ``Exchange``)."""
    mine = [pieces[m][rank] for m in range(len(matrices)) if rank in pieces[m]]
    send = sorted(mine, key=lambda p: (owners[p.matrix], p.matrix))
    send_sizes = [0] * world
    for p in send:
        send_sizes[owners[p.matrix]] += p.stop - p.first
    owned = [m for m in range(len(matrices)) if owners[m] == rank]
    shapes: dict[tuple[int, int], list[int]] = {}
    for m in owned:
        shapes.setdefault(matrices[m].shape, []).append(m)
    at, offset = {}, 0  # matrix -> its first element in the owned buffer
    for shape, ms in shapes.items():
        for m in ms:
            at[m] = offset
            offset += shape[0] * shape[1]
    received: list[Piece] = []
    recv_sizes = []
    for h in range(world):
        runs = [pieces[m][h] for m in owned if h in pieces[m]]
        received += runs
        recv_sizes.append(sum(p.stop - p.first for p in runs))
    order = sorted(range(len(received)),
                   key=lambda i: (at[received[i].matrix], received[i].offset))
    back = tuple((at[p.matrix] + p.offset, at[p.matrix] + p.offset + p.stop - p.first)
                 for p in received)
    return Exchange(tuple(send), tuple(send_sizes), tuple(recv_sizes),
                    tuple(p.stop - p.first for p in received), tuple(order), back,
                    tuple((shape, len(ms)) for shape, ms in shapes.items()))
