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

import logging
from typing import Any, Callable, NamedTuple

import torch

from ..comm.collectives import Comm, all_to_all, wait
from ..schedule.structure import Role
from ..sharding.matrices import Rest, is_matrix, matrix_runs, rest_columns, rest_of
from ..sharding.model import ShardedModel
from ..sharding.params import Params, check_tree
from .adamw import adamw
from .base import GradientTransformation, model_comm
from .checks import FIX_STATE, refuse_donated_tree
from .newton_schulz import orthogonalize
from .owners import Exchange, plan

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
    _check_hyper(lr, weight_decay, momentum, ns_coefficients, ns_steps, adjust_lr_fn)
    comm = model_comm(model, "muon")
    _check_matrices(model)
    ex = plan(model.parts, comm.world_size, ns_steps).exchange(comm.rank)
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

    def step(grads: Params, state: MuonState, params: Params | None, inplace: bool):
        """``(count, momentum, matrix updates by part)``. Collective (the exchange)."""
        _check(model, grads, state, params, weight_decay)
        if comm.heartbeat is not None:  # its place, after the checks: a rank that raised or
            comm.heartbeat.inside("fz3.optim.muon's update")  # never came is named by the others
        count = state.count + 1
        rate = lr(int(count)) if callable(lr) else lr
        mom, u = _momentum(grads, state.momentum, runs, momentum, nesterov, inplace)
        got = exchange(comm, ex, u, ns)
        upd = _matrix_updates(got, ex, u, params, runs, ratios, rate, weight_decay)
        return count, mom, upd

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

    return GradientTransformation(init, update, update_inplace)


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


def exchange(comm: Comm, ex: Exchange, u: dict[int, torch.Tensor], ns: dict) -> torch.Tensor:
    """This rank's slices of every matrix's orthogonalized U: ``u`` (per stack part, (k, shard)
    fp32) to the owners, NS there, the results back; 1-D bf16, the slices in ``ex.send``
    order. Collective: two all-to-alls over the model's gradient group, on every rank (one
    that owns nothing, or holds nothing, sends and receives nothing)."""
    device = next(iter(u.values())).device if u else torch.device("cpu")
    bf16 = dict(dtype=torch.bfloat16, device=device)
    sent = torch.empty(sum(ex.send_sizes), **bf16)
    if ex.send:  # rounds to bf16 as it packs: NS's first step, the same bits
        torch.cat([u[p.part][p.row, p.first:p.stop] for p in ex.send], out=sent)
    got = torch.empty(sum(ex.recv_sizes), **bf16)
    wait(all_to_all(comm, got, sent, list(ex.recv_sizes), list(ex.send_sizes),
                    label="Muon: matrix slices to their owners"))
    owned = torch.empty(sum(n * a * b for (a, b), n in ex.groups), **bf16)
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
    back = torch.empty_like(sent)
    return wait(all_to_all(comm, back, got, list(ex.send_sizes), list(ex.recv_sizes),
                           label="Muon: orthogonalized slices back"))


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


def _matrix_updates(got: torch.Tensor, ex: Exchange, like: dict[int, torch.Tensor],
                    params: Params | None,
                    runs: dict[int, list[tuple[int, int]]], ratios: dict[int, list],
                    rate: float, weight_decay: float) -> dict[int, torch.Tensor]:
    """Per stack part, (k, shard) fp32: ``-lr ratio O - lr wd W`` on the matrices' columns,
    zero elsewhere."""
    upd = {i: torch.zeros_like(t) for i, t in like.items()}
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


def _check_hyper(lr, weight_decay, momentum, coefficients, steps, adjust_lr_fn) -> None:
    """torch.optim.Muon's refusals, at construction."""
    if (not callable(lr) and lr < 0) or weight_decay < 0 or momentum < 0:
        raise ValueError(f"fz3.optim.muon: lr={lr}, weight_decay={weight_decay}, "
                         f"momentum={momentum} must be >= 0")
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"fz3.optim.muon: adjust_lr_fn={adjust_lr_fn!r}: pass None, 'original' "
                         f"or 'match_rms_adamw'")
    if len(coefficients) != 3 or not 0 < steps < 100:
        raise ValueError(f"fz3.optim.muon: ns_coefficients={coefficients} (three numbers) and "
                         f"ns_steps={steps} (1 to 99)")


def _check_matrices(model: ShardedModel) -> None:
    """Refuse what Muon cannot orthogonalize, naming it; say once (rank 0) which 3-D
    parameters are orthogonalized one matrix per leading index (stacked experts)."""
    stacks = [p for p in model.parts if p.role is Role.STACK and p.layout.slots]
    if not stacks:
        raise ValueError("fz3.optim.muon: the model has no layer stack with trained parameters; "
                         "Muon orthogonalizes the 2-D parameters of layer stacks: use "
                         "fz3.optim.adamw for this model")
    experts = []
    for part in stacks:
        for s in part.layout.slots:
            if len(s.shape) > 3:
                raise ValueError(f"fz3.optim.muon: {part.prefix()}{s.name} is {list(s.shape)}: "
                                 f"Muon orthogonalizes 2-D parameters (3-D: one matrix per "
                                 f"leading index). Make it a 2-D parameter of the module (a "
                                 f"view in forward), or freeze it (requires_grad=False)")
            if len(s.shape) == 3:
                experts.append(f"{part.path}.*.{s.name} {list(s.shape)}")
        if not any(is_matrix(part, s) for s in part.layout.slots):
            raise ValueError(f"fz3.optim.muon: the layer stack {part.name} has no 2-D parameter "
                             f"to orthogonalize (it trains {[s.name for s in part.layout.slots]}):"
                             f" use fz3.optim.adamw, or train its matrices")
    if experts and model.is_root:
        log.info("fz3.optim.muon: %s orthogonalized per expert (one matrix per leading index)",
                 ", ".join(experts))


def _check(model: ShardedModel, grads: Params, state: Any, params: Params | None,
           weight_decay: float) -> None:
    """The trees fit this model and the state is muon's, built for it; refused naming the
    part, before any collective."""
    if not isinstance(state, MuonState):
        raise TypeError(f"the optimizer state is {type(state).__name__}, muon's is a MuonState: "
                        f"{FIX_STATE}")
    if params is None and weight_decay:
        raise ValueError("muon with weight_decay needs params: opt.update(grads, state, params)")
    check_tree(model, grads, "the gradients")
    if params is not None:
        check_tree(model, params)
    refuse_donated_tree(state.momentum, "the optimizer state")
    moms = state.momentum.parts if isinstance(state.momentum, Params) else ()
    if len(moms) != len(model.parts):
        raise TypeError(f"the optimizer state's momentum has {len(moms)} parts, the model "
                        f"{len(model.parts)}: {FIX_STATE}")
    for part, m, g in zip(model.parts, moms, grads.parts):
        want = g if part.role is Role.STACK else None
        if (m is None) != (want is None) or (m is not None and (
                m.shape != want.shape or m.dtype != want.dtype or m.device != want.device)):
            show = lambda t: "none" if t is None else f"{list(t.shape)} {t.dtype} on {t.device}"
            raise ValueError(f"the optimizer state's momentum of part {part.name} is {show(m)}, "
                             f"this model's is {show(want)}: {FIX_STATE}")
