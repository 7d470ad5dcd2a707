"""Muon (Keller Jordan 2024) on flat shards, with ``torch.optim.Muon``'s equations (torch 2.13)
for every stack matrix; ``others`` (AdamW by default) for every other element.

Per matrix W (shape A x B) with gradient G, momentum M (fp32, zero at first):

    M <- lerp(M, G, 1 - mu)                      U = lerp(G, M, mu) if nesterov else M
    O = NS(bf16(U))                               (newton_schulz.py, ns_steps iterations)
    W <- W - lr wd W - lr ratio(A, B) O           ratio: adjust_lr_fn on the 2-D shape

M and U are elementwise: each rank computes them on its own slices (M stays sharded like W,
zero on the columns that are not matrices). NS needs W's matrix whole: the exchange
(``owners.py``) sends each slice of U, in bf16 (NS's first operation rounds to bf16 anyway),
to the matrix's owner, which orthogonalizes its matrices one shape at a time as a batch,
and sends the slices of O back. Two all-to-alls a step; a rank owning nothing takes part.

``update`` returns ``-lr ratio O - lr wd W`` on the matrices' elements; ``update_inplace``
(``fz3.optim.step(..., donate=True)``) adds the same updates in place, so both paths give the
matrices the same bits. Elements outside matrices go to ``others`` as a ``Rest``
(``fz3/sharding/matrices.py``), its state holding nothing for the matrices' elements.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, NamedTuple

import torch

from ..comm.collectives import Comm
from ..schedule.structure import Role
from ..sharding.matrices import Rest, is_matrix, matrix_runs, rest_columns, rest_of
from ..sharding.model import ShardedModel
from ..sharding.params import Params, check_tree
from .adamw import adamw
from .base import GradientTransformation, UnitStep, model_comm
from .checks import FIX_STATE
from .muon_checks import check_hyper, check_matrices, check_state
from .muon_exchange import Exchanging, exchange
from .owners import Exchange, Plan, plan

log = logging.getLogger(__name__)


def lr_ratio(adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    """torch.optim.Muon's ``adjust_lr_fn`` on a matrix of ``shape`` (A, B): None and
    ``"original"``: sqrt(max(1, A / B)) (Keller Jordan's); ``"match_rms_adamw"``:
    0.2 sqrt(max(A, B)) (Moonshot's, to reuse AdamW's lr and weight decay)."""
    a, b = shape[-2:]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * max(a, b) ** 0.5
    return max(1.0, a / b) ** 0.5


class MuonState(NamedTuple):
    count: torch.Tensor  # () int64 on the CPU: steps taken
    momentum: Params  # stack parts (k, shard) fp32, zero off the matrices; None for other parts
    others: Any  # the state of ``others``, over the Rest


def muon(model: ShardedModel, lr: float | Callable[[int], float] = 1e-3, weight_decay: float = 0.1,
         momentum: float = 0.95, nesterov: bool = True,
         ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315), eps: float = 1e-7,
         ns_steps: int = 5, adjust_lr_fn: str | None = None,
         others: GradientTransformation | None = None) -> GradientTransformation:
    """Muon for each 2-D parameter of a layer stack (3-D: each matrix of its leading index),
    ``others`` (default ``fz3.optim.adamw()``) for the rest, given as a ``Rest``. ``lr`` may be
    a schedule ``step -> lr`` (step counts from 1). Its owners and slices are planned here,
    once. Collective: ``update`` and ``update_inplace`` (two all-to-alls over the model's
    sharding group: every rank calls them)."""
    check_hyper(lr, weight_decay, momentum, ns_coefficients, ns_steps, adjust_lr_fn)
    comm = model_comm(model, "muon")
    check_matrices(model)
    owners = plan(model.parts, comm.world_size, ns_steps)
    ex = owners.exchange(comm.rank)
    stacks = [i for i, p in enumerate(model.parts) if p.role is Role.STACK]
    runs = {i: matrix_runs(model.parts[i], comm.rank) for i in stacks}
    ratios = {i: _ratio_runs(model.parts[i], comm.rank, adjust_lr_fn) for i in stacks}
    columns = [rest_columns(p, comm.rank, model.device) for p in model.parts]
    others = adamw() if others is None else others
    ns = dict(coefficients=tuple(ns_coefficients), steps=ns_steps, eps=eps)

    def init(params: Params) -> MuonState:
        check_tree(model, params)
        zeros = Params(tuple(torch.zeros_like(t) if i in runs else None
                             for i, t in enumerate(params.parts)))
        return MuonState(torch.zeros((), dtype=torch.int64), zeros,
                         others.init(rest_of(model, params, columns)))

    setup = Setup(model, comm, runs, ratios, columns, others, ns, lr, weight_decay, momentum,
                  nesterov, owners, {})
    step = functools.partial(_step, setup, ex)

    def update(grads: Params, state: MuonState,
               params: Params | None = None) -> tuple[Params, MuonState]:
        count, mom, upd = step(grads, state, params, inplace=False)
        rest_p = None if params is None else rest_of(model, params, columns)
        rest_u, rest_state = others.update(rest_of(model, grads, columns), state.others, rest_p)
        out = [upd[i].index_copy_(1, columns[i], r) if i in upd else r
               for i, r in enumerate(rest_u.parts)]
        return Params(tuple(out)), MuonState(count, mom, rest_state)

    def update_inplace(grads: Params, state: MuonState,
                       params: Params) -> tuple[Params, MuonState]:
        count, mom, upd = step(grads, state, params, inplace=True)
        for i, u in upd.items():
            params.parts[i].add_(u)  # the update path's apply_updates, in place: the same bits
        rest_state = _others_inplace(others, rest_of(model, grads, columns), state.others,
                                     params, rest_of(model, params, columns), columns)
        return params, MuonState(count, mom, rest_state)

    per_unit = None if others.per_unit is None else functools.partial(_per_unit, setup)
    return GradientTransformation(init, update, update_inplace, per_unit)


def _step(m: "Setup", ex: Exchange, grads: Params, state: MuonState, params: Params | None,
          inplace: bool) -> tuple:
    """``(count, momentum, matrix updates by part)``. Collective (the exchange)."""
    count, rate = _tick(m, grads, state, params)
    if m.comm.heartbeat is not None:  # its place, after the checks: a rank that raised or
        m.comm.heartbeat.inside("fz3.optim.muon's update")  # never came is named by the others
    mom, u = _momentum(grads, state.momentum, m.runs, m.momentum, m.nesterov, inplace)
    got = exchange(m.comm, ex, u, m.ns)
    zeros = {i: torch.zeros_like(t) for i, t in u.items()}
    upd = _matrix_updates(got, ex, zeros, params, m.runs, m.ratios, rate, m.weight_decay)
    return count, mom, upd


def _tick(m: "Setup", grads: Params, state: Any, params: Params | None) -> tuple:
    """``(count, lr)`` of the step about to be taken, the trees and state checked first."""
    if not isinstance(state, MuonState):
        raise TypeError(f"the optimizer state is {type(state).__name__}, muon's is a "
                        f"MuonState: {FIX_STATE}")
    check_state(m.model, grads, state, params, m.weight_decay)
    count = state.count + 1
    return count, m.lr(int(count)) if callable(m.lr) else m.lr


class Setup(NamedTuple):
    """What ``muon`` decides once, for its per-unit form (``_per_unit``)."""

    model: ShardedModel
    comm: Comm
    runs: dict[int, list[tuple[int, int]]]
    ratios: dict[int, list]
    columns: list[torch.Tensor | None]
    others: GradientTransformation
    ns: dict
    lr: float | Callable[[int], float]
    weight_decay: float
    momentum: float
    nesterov: bool
    owners: Plan  # the whole model's
    exchanges: dict  # (part, first, stop) -> a unit's Exchange, made at its first update


def _per_unit(m: Setup, state: MuonState, params: Params) -> UnitStep:
    """``update_inplace``'s step a unit at a time (``fz3.train_step``): a stack unit's
    matrices are sent to their owners (in the whole model's plan) as its gradient lands, and
    then every exchange already in flight moves one stage on (``Exchanging``): the next
    update orthogonalizes them and sends the results back, the one after writes them. So
    each all-to-all travels while the units below run their backward, and no rank waits for
    the others' Newton-Schulz of a unit before it has sent the next and done its share of the
    one before: the critical path nears the busiest rank's total, not the sum of each unit's
    busiest (``benchmarks/muon.py`` counts both). ``finish`` lands the rest; ``others`` steps
    the rest per unit. Collective: every update and ``finish`` (the all-to-alls)."""
    count, rate = _tick(m, params, state, params)
    rest = rest_of(m.model, params, m.columns)
    inner = m.others.per_unit(state.others, rest)
    one = functools.partial(_one, len(m.model.parts))
    # (part, exchange, under way, its parameter rows, the gradient's dtype), oldest first
    flying: list[tuple[int, Exchange, Exchanging, torch.Tensor, torch.dtype]] = []

    def advance(older: list) -> None:
        """Each exchange of ``older`` (newest first) one stage on, those done written into
        their rows: a rank orthogonalizes its share of one unit before it waits for the
        others' share of the unit before."""
        for entry in older:
            i, ex, going, mine, dtype = entry
            got = going.advance()
            if got is not None:
                flying.remove(entry)
                zeros = {i: torch.zeros_like(mine, dtype=dtype)}
                upd = _matrix_updates(got, ex, zeros, one(i, mine),
                                      {i: m.runs[i]}, {i: m.ratios[i]}, rate, m.weight_decay)
                mine.add_(upd[i])

    def step_layers(i: int, layers: slice | None, grad: torch.Tensor) -> None:
        if m.comm.heartbeat is not None and (flying or i in m.runs):
            m.comm.heartbeat.inside("fz3.optim.muon's update")
        older = flying[::-1]
        if i in m.runs:  # a stack part: its matrices on their way first, then its rest
            ex = m.exchanges.get((i, layers.start, layers.stop))
            if ex is None:  # the whole model's owners: a step's loads are the same
                ex = m.exchanges[i, layers.start, layers.stop] = m.owners.only(i, layers).exchange(
                    m.comm.rank)
            _, u = _momentum(one(i, grad), one(i, state.momentum.parts[i][layers]),
                             {i: m.runs[i]}, m.momentum, m.nesterov, inplace=True)
            going = Exchanging(m.comm, ex, u, m.ns)
            flying.append((i, ex, going, params.parts[i][layers], grad.dtype))
        advance(older)
        cols = m.columns[i]
        inner.update(i, layers, grad if cols is None else grad.index_select(1, cols))

    def finish() -> tuple[Params, MuonState]:
        while flying:
            advance(flying[::-1])
        _, others_state = inner.finish()
        # the stacks' rest columns back, once every row is stepped: ``others`` may step a
        # row's first elements with the next unit's (``fz3.optim.aligned``)
        for i, cols in enumerate(m.columns):
            if cols is not None:
                params.parts[i].index_copy_(1, cols, rest.parts[i])
        return params, MuonState(count, state.momentum, others_state)

    return UnitStep(step_layers, finish)


def _one(parts: int, i: int, t: torch.Tensor) -> Params:
    """A ``Params`` of ``parts`` parts holding ``t`` as part ``i``, None elsewhere."""
    return Params(tuple(t if j == i else None for j in range(parts)))


def _others_inplace(others: GradientTransformation, grads: Rest, state: Any, params: Params,
                    rest: Rest, columns: list[torch.Tensor | None]) -> Any:
    """``others``' step on ``rest`` (``params``' Rest), in place where it has an in-place path;
    the stacks' columns (updated on copies) written back into ``params``. Its new state."""
    if others.update_inplace is not None:
        rest, state = others.update_inplace(grads, state, rest)
    else:
        updates, state = others.update(grads, state, rest)
        rest = Rest(tuple(p.add_(u) for p, u in zip(rest.parts, updates.parts)))
    for i, cols in enumerate(columns):
        if cols is not None:
            params.parts[i].index_copy_(1, cols, rest.parts[i])
    return state


def _momentum(grads: Params, momentum: Params, runs: dict[int, list[tuple[int, int]]], mu: float,
              nesterov: bool, inplace: bool) -> tuple[Params, dict[int, torch.Tensor]]:
    """The new momentum (in place, or new buffers) and U per stack part, on the matrices'
    columns (U's other columns are never read)."""
    new, u = list(momentum.parts), {}
    for i, cols in runs.items():
        g, m = grads.parts[i], momentum.parts[i]
        out = m if inplace else torch.zeros_like(m)
        u[i] = torch.empty_like(g) if nesterov else out
        for a, b in cols:
            torch.lerp(m[:, a:b], g[:, a:b], 1 - mu, out=out[:, a:b])
            if nesterov:
                torch.lerp(g[:, a:b], out[:, a:b], mu, out=u[i][:, a:b])
        new[i] = out
    return Params(tuple(new)), u


def _matrix_updates(got: torch.Tensor, ex: Exchange, upd: dict[int, torch.Tensor],
                    params: Params | None,
                    runs: dict[int, list[tuple[int, int]]], ratios: dict[int, list],
                    rate: float, weight_decay: float) -> dict[int, torch.Tensor]:
    """``upd`` (per stack part, (k, shard) fp32 zeros) filled: ``-lr ratio O - lr wd W`` on
    the matrices' columns, zero elsewhere."""
    sizes = [p.stop - p.first for p in ex.send]
    for p, piece in zip(ex.send, torch.split(got, sizes) if sizes else ()):
        upd[p.part][p.row, p.first:p.stop].copy_(piece)
    for i, u in upd.items():
        scale = torch.zeros(1, u.shape[1], device=u.device)
        for a, b, ratio in ratios[i]:
            scale[:, a:b] = -(rate * ratio)  # torch's alpha=-adjusted_lr, computed in double
        u.mul_(scale)
        if weight_decay and params is not None:
            for a, b in runs[i]:
                u[:, a:b].add_(params.parts[i][:, a:b], alpha=-rate * weight_decay)
    return upd


def _ratio_runs(part: Any, rank: int, adjust_lr_fn: str | None) -> list[tuple[int, int, float]]:
    """``(first, stop, lr ratio)`` of each matrix's columns in rank ``rank``'s shard of a stack."""
    return [(c.start, c.stop, lr_ratio(adjust_lr_fn, s.shape))
            for s, _, c in part.layout.local_pieces(rank) if is_matrix(part, s)]
