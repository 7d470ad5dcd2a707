"""The front door: ``value_and_grad``, ``apply``, ``accumulate`` and ``step_through`` each
call ``prepare`` once and ``check_call`` on every call. A rank that would take another path
raises here, on every rank, instead of hanging inside a collective later.
"""

from __future__ import annotations

from typing import Any, Callable, Generator, Sequence

import logging
from logging import WARNING

import optree
import torch

from ..compare import fingerprint
from ..comm.collectives import differing_ranks
from ..comm.failures import gather_objects
from ..comm.groups import refuse_destroyed
from ..comm.liveness import Place
from ..comm.out_of_step import steps_apart
from ..comm.say import once
from ..schedule.ops import OpKind
from ..schedule.saveable import cuts, name_of
from ..schedule.planner import Policy, plan, updating
from ..schedule.schedule import Schedule, validate
from ..sharding.model import Params, ShardedModel
from ..sharding.params import check_tree
from .state import Loss, Result
from .traced import TracedLayers

log = logging.getLogger(__name__)


def prepare(model: ShardedModel, schedule: Schedule | Policy | None, *, grad: bool,
            entry: str, updates: str | None = None) -> Schedule:
    """The schedule ``entry`` runs: planned from a ``Policy`` (None: the default policy) or a
    hand-made ``Schedule`` validated, refused if it holds ``accumulate`` ops, with an
    ``update`` op after each ``wait_reduce`` where ``updates`` is ``"each"``, or all after
    the backward where it is ``"last"`` (``fz3.train_step``: ``fz3.optim.per_unit.placement``),
    and it has none, then compared across ranks. **Collective**: one small all-gather
    over the sharding group."""
    sched = check_schedule(model, schedule, grad=grad, entry=entry)
    sched = updating(sched, last=updates == "last") if updates else sched
    differ, _ = differing_ranks(model.comm, list(sched.fingerprint()), model.device,
                                f"{entry}'s schedule check")
    if differ:
        raise ValueError(f"ranks {differ} planned a different schedule than rank 0 for {entry} "
                         f"(policy, layers per unit or a hand-made schedule differ); every rank "
                         f"must run the same schedule or the step hangs")
    return sched


def check_schedule(model: Any, schedule: Schedule | Policy | None, *, grad: bool,
                   entry: str = "value_and_grad") -> Schedule:
    """Local part of ``prepare``: plan or validate, and refuse what ``entry`` cannot run."""
    if schedule is None or isinstance(schedule, Policy):
        return plan(model, schedule or Policy(), grad=grad)
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be an fz3.Schedule or fz3.Policy, "
                        f"got {type(schedule).__name__}")
    if not _covers(schedule, model):
        raise ValueError(f"the schedule's units {[u.name for u in schedule.units]} are not this "
                         f"model's parts {[p.name for p in model.parts]}; build it with "
                         f"fz3.plan(model, policy) and take its units for a hand-made one")
    if schedule.grad != grad:
        raise ValueError(f"schedule.grad={schedule.grad}: {entry} needs a "
                         f"{'training' if grad else 'forward-only'} schedule "
                         f"(fz3.plan(..., grad={grad}))")
    held = [i for i, op in enumerate(schedule.ops) if op[0] == OpKind.ACCUMULATE]
    if held:
        raise ValueError(f"schedule op {held[0]} is accumulate: a schedule from fz3.deferred is "
                         f"run only inside fz3.accumulate(policy='defer') for the micro-batches "
                         f"before the last; {entry} needs a schedule that reduces (pass the one "
                         f"you gave fz3.deferred)")
    if schedule.updates and entry != "train_step":
        raise ValueError(f"the schedule holds update ops: only fz3.train_step runs them (it "
                         f"steps the parameters); {entry} needs the schedule without them")
    return validate(schedule)


def _covers(schedule: Schedule, model: ShardedModel) -> bool:
    """Every row of every part in exactly one unit, with the part's role and reads."""
    rows: dict[int, list[int]] = {}
    for u in schedule.units:
        if not 0 <= u.part < len(model.parts) or u.role is not model.parts[u.part].role:
            return False
        rows.setdefault(u.part, []).extend(u.layers)
        reads = {schedule.units[r].part for r in u.reads}
        if reads != set(model.parts[u.part].reads):
            return False
    return all(sorted(rows.get(i, [])) == list(range(p.rows)) for i, p in enumerate(model.parts))


def check_call(model: ShardedModel, params: Params, *batches: Any,
               entry: str = "the step", labels: bool = True) -> list[str]:
    """Params and batches, locally, before any collective; then the call is counted. Returns
    why batches have nothing to learn from (``check_batch``), for ``check_in_sync`` to say on
    every rank. ``labels=False``: a forward for an output, which needs none."""
    refuse_destroyed(model.comm, entry)
    check_params(model, params)
    empty = [why for why in (check_batch(model, b, labels) for b in batches) if why is not None]
    # counted after the local checks and before any collective: a rank that raised before
    # here, or never came, has entered fewer calls, one that ran a step more has entered more,
    # and the ranks left waiting name them where they are ([Note: a rank that never comes] in
    # ``fz3/comm/collectives.py``)
    if model.comm.heartbeat is not None:
        model.comm.heartbeat.entered(entry)
    return empty


def check_params(model: ShardedModel, params: Params) -> None:
    """Cheap shape/dtype/device checks (fp32 master shards), and contiguity: collectives send
    them as they are, and one rank computes on them (``fz3.comm``)."""
    check_tree(model, params, "params", torch.float32)
    for part, t in zip(model.parts, params.parts):
        if not t.is_contiguous():
            raise ValueError(f"params of part {part.name} are not contiguous (strides "
                             f"{t.stride()} for shape {list(t.shape)}): pass contiguous shards, "
                             f"e.g. optree.tree_map(torch.Tensor.contiguous, params)")


def check_batch(model: ShardedModel, batch: Any, labels: bool = True) -> str | None:
    """Every tensor in the batch lives on the model's device, and the model's adapter (if
    any) accepts it. Returns why the batch has nothing to learn from (0 rows, or the adapter's
    say: no labelled token), else None."""
    leaves = optree.tree_leaves(batch, none_is_leaf=True)
    for i, t in enumerate(leaves):
        if isinstance(t, torch.Tensor) and t.device != model.device:
            path = _leaves_with_paths(batch)[2][i]  # named on the error path only
            raise TypeError(f"batch{path} is on {t.device}, the model on {model.device}: move the "
                            f"batch to {model.device} (e.g. batch = optree.tree_map(lambda t: "
                            f"t.to('{model.device}'), batch))")
    if any(isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == 0 for t in leaves):
        return "0 rows"
    return None if model.check_batch is None else model.check_batch(batch, labels=labels)


def check_in_sync(model: ShardedModel, step: int, entry: str, batches: Sequence[Any],
                  empty: list[str]) -> None:
    """Same step call on the model and the same step count, and batches of the same structure,
    shapes and dtypes, none empty (``empty``: this rank's reasons, from ``check_call``), on
    every rank. **Collective**: one all-gather of a few integers (and, on a mismatch, one more
    to say what differs); a rank that never comes is named when the wait passes
    ``fz3.shard``'s ``timeout`` ([Note: a rank that never comes])."""
    sigs = [_signature(b) for b in batches]
    # the step calls this rank entered on the model, every step function's (``check_call``)
    beat = model.comm.heartbeat
    calls = beat.place.calls if beat is not None else step
    differ, rows = differing_ranks(model.comm, [calls, step, bool(empty), *fingerprint(sigs)],
                                   model.device, f"{entry}'s check that the ranks agree")
    hollow = [r for r in range(model.world_size) if rows[r, 2]]
    if not differ and not hollow:
        return
    for column, counted in ((0, "step calls on this model: value_and_grad's, apply, "
                                "accumulate's, step_through"), (1, "calls of this step function")):
        if any(rows[r, column] != rows[0, column] for r in differ):
            at = {k: Place(int(rows[k, column]) + (column == 1)) for k in range(model.world_size)}
            raise RuntimeError(f"{entry}: {steps_apart(at)} ({counted}): some rank skipped or "
                               f"repeated a step (a loop bound or a skipped batch that differs by "
                               f"rank?); every rank must make the same calls equally often")
    # the error path only: every rank's batches described for people (paths, shapes, dtypes)
    everyone = gather_objects(model.comm.group, ([_described(b) for b in batches], empty))
    shown = "; ".join(f"rank {k}: {' | '.join(d)}" for k, (d, _) in enumerate(everyone))
    if hollow:
        why = "; ".join(f"rank {k}: {', '.join(everyone[k][1])}" for k in hollow)
        raise ValueError(f"{entry}: ranks {hollow} have an empty batch ({why}): the loss would be "
                         f"NaN on every rank while the gradients stay finite; drop that batch on "
                         f"every rank")
    raise ValueError(f"{entry}: ranks {differ} have batches shaped unlike rank 0's ({shown}). "
                     f"fz3's loss is the mean of per-rank mean losses, the global mean only when "
                     f"every rank's batch has the same shape: pad or drop the last batch, or pass "
                     f"check_sync=False to allow it")


def _signature(batch: Any) -> tuple:
    """The batch's structure and each tensor's shape and dtype (no values read)."""
    leaves, spec = optree.tree_flatten(batch, none_is_leaf=True)
    return (str(spec), *((tuple(t.shape), str(t.dtype).removeprefix("torch."))
                         if isinstance(t, torch.Tensor) else type(t).__name__ for t in leaves))


def _described(batch: Any) -> str:
    """``"batch['input_ids'] [4, 32] int64, batch['labels'] [4, 32] int64"``."""
    leaves, _, paths = _leaves_with_paths(batch)
    out = [f"batch{p} {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
           for t, p in zip(leaves, paths) if isinstance(t, torch.Tensor)]
    return ", ".join(out) or "no tensors"


def loss_of(model: ShardedModel, loss: Callable[..., Any] | None, has_aux: bool) -> Loss:
    """The function the ``loss`` op runs: ``loss(m, h, batch)`` bound to the model (default:
    the model's ``post``)."""
    if loss is not None and not callable(loss):
        raise TypeError(f"loss must be a function (m, h, batch) -> loss, got {type(loss).__name__}")
    return Loss(model.post if loss is None else model.bind_loss(loss), has_aux)


def drain(gen: Generator[Any, None, Result]) -> Result:
    """Run the executor to the end; return its ``Result``."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def _leaves_with_paths(tree: Any) -> tuple[list, Any, list[str]]:
    paths, leaves, spec = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    return leaves, spec, ["".join(f"[{k!r}]" for k in p) for p in paths]


def layer_runner(model: ShardedModel, *, trace: bool, compile: bool,
                 strict: bool) -> TracedLayers | None:
    """What runs the layers: traced programs (compiled by inductor with ``compile``), or None:
    autograd. Local: ``compile`` and ``strict`` without ``trace`` are refused."""
    if compile and not trace:
        raise ValueError("compile=True compiles the traced layer programs: pass trace=True "
                         "(the default), or compile=False with trace=False")
    if strict and not compile:
        raise ValueError("strict=True asks compile=True to raise instead of running a program "
                         "inductor cannot compile as Python; pass compile=True with it")
    return TracedLayers(model, compile=compile, strict=strict) if trace else None


def say_untraced_selective(schedule: Schedule, traced: TracedLayers | None) -> None:
    """A predicate other than save or recompute cuts traced programs: with ``trace=False`` a
    forward carrying one runs as recompute. Said once, a WARNING."""
    cut = sorted({name_of(op.saves) for op in schedule.ops if op.saves and cuts(op.saves)})
    if traced is None and cut:
        once(log, WARNING, "fz3: trace=False: forward units keeping by %s run as recompute "
             "(a predicate keeps what traced programs compute; pass trace=True)",
             ", ".join(cut))


def refuse_fixed_buffers(value: object, entry: str) -> None:
    """``fixed_buffers=`` was an option until every step wrote into the same memory."""
    if value is not None:
        raise TypeError(f"{entry}(fixed_buffers={value!r}): buffers are fixed by design now "
                        f"(each unit's memory is made once, fz3.step.memory); drop the argument")
