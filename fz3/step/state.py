"""``StepState``: everything one step's ops share, by unit, for one call of the executor.

The steps of ``fz3/step/executor.py`` (and the ``unit_io`` functions they call) read and write
it; nothing else does. It answers the two questions others ask about a running step: which
bytes it owns and moves (for ``Recorder``) and which collectives are still in flight (to
drain them when a step ends early).

Each buffer's lifetime, where a reduce lands (``executor.result_lander``) and a shared unit's
gradient: ``fz3.step.memory``'s [Note: a unit's memory]. A forward keeps its engine's
residuals (``fz3.step.engine``); the loss's mean over ranks is all-reduced as soon as it
exists and waited at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Union

import torch

from ..comm.collectives import Pending
from ..rng import RngState
from ..schedule.ops import Op, OpKind
from ..schedule.schedule import Schedule
from ..sharding.binding import Binding
from ..sharding.model import Params, ShardedModel
from .engine import Pieces, Replay


class Frame(NamedTuple):
    """Yielded after each compute op. References only: building it costs nothing."""

    index: int  # position of the op in the schedule
    op: Op
    # the unit's gathered parameters: (padded,), or (k, padded) for k layers; read-only
    params: torch.Tensor
    inputs: Any  # forward: the unit's input (the batch for pre); backward: grad w.r.t. its output
    # forward: its output (h, or (h, *extra) for pre and between; the loss for `loss`; a
    # layer unit's (h, aux) with layer_aux, aux (k, *shape)); backward: grad w.r.t. its input.
    # With layer_aux a layer unit's backward inputs are (grad of h, grad of aux), and the
    # loss's inputs (h, the stacks' aux outputs)
    outputs: Any
    grad: torch.Tensor | None  # backward and loss: the unit's full flat gradient before reduction
    reads: dict[int, torch.Tensor] | None = None  # gathered buffers of the shared units it reads
    frozen: torch.Tensor | None = None  # the unit's gathered frozen parameters, if any
    # backward and loss: its flat gradient contribution to each shared unit it reads (a tied
    # embedding's, from the head), before the contributions are summed and reduced
    read_grads: dict[int, torch.Tensor] | None = None


class Result(NamedTuple):
    loss: torch.Tensor  # () fp32, mean over ranks
    grads: Params | None  # shards of the gradient of the mean loss (None for forward-only)
    aux: Any = None  # this rank's auxiliary output of the loss function (has_aux), detached


class Loss(NamedTuple):
    """The function the ``loss`` op runs: ``fn(m, h, batch) -> loss``, or ``(loss, aux)``."""

    fn: Binding
    has_aux: bool = False


# One op of a lowered schedule (``fz3.step.executor.lower``): everything about the op that
# does not change between steps decided when it was made; run on the step's state.
Step = Callable[["StepState"], Union[Frame, None]]


class Gathering(NamedTuple):
    """A unit's gathers, issued and not yet waited (its ``StepState.params`` record)."""

    trained: Pending
    frozen: Pending | None  # its frozen parameters', gathered apart; None: it has none

    def pending(self) -> tuple[Pending, ...]:
        return (self.trained,) if self.frozen is None else (self.trained, self.frozen)


class Reducing(NamedTuple):
    """A unit's reduce, issued and not yet waited (its ``StepState.grad`` record)."""

    pending: Pending
    shard: torch.Tensor  # (k * shard,) fp32, in the result: where this rank's gradient lands


class Call(NamedTuple):
    """The call's inputs (``fz3.step.executor.execute``'s arguments): the record is fixed for
    the step; ``carry``'s dict is not (``reduce`` pops from it, ``accumulate`` adds to it)."""

    model: ShardedModel
    schedule: Schedule
    shards: Params  # the sharded parameters (``StepState.params``: the gathered, by unit)
    batch: Any
    loss_fn: Loss
    loss_scale: float | torch.Tensor  # multiplies the backward's seed (fp16 scaling, 1/k)
    carry: dict[int, torch.Tensor] | None  # flat gradients accumulated across micro-batches
    reduce_replicas: bool  # hybrid: sum the shard across replicas at each wait_reduce
    traced: Any  # fz3.step.traced.TracedLayers: layers run as traced programs; None: not
    frames: bool  # False: compute ops make no Frame (nobody looks at them)
    # ``update`` ops' step (``fz3.optim.UnitStep.update``: part, layers, reduced gradient), or None
    update: Callable[[int, slice | None, torch.Tensor], None] | None = None


class Reduced(NamedTuple):
    """A unit's reduced gradient shard waiting for its ``update`` op (its ``StepState.grad``
    record; ``fz3.train_step``): a buffer of its own, ``(k * shard,)`` fp32, freed by it."""

    shard: torch.Tensor


class Shard(NamedTuple):
    """A part's gradient shard in the step's result, where its units' reduces land."""

    grad: torch.Tensor  # (rows, shard) fp32 for a stack part, (shard,) for the others
    rows: tuple[torch.Tensor, ...]  # a stack part's: each layer's row of ``grad``


@dataclass(eq=False)
class StepState:
    """By unit, a record for each state ``fz3.schedule.ops.UnitState`` names:
    ``params``: ``Gathering``, then ``Pieces`` (its memory); ``activation``: ``(engine,
    residuals)``, what its forward kept (``fz3.step.engine``); ``grad``: before its backward
    the cotangents of its outputs after h, by output position (a dict: the layers add their
    extras' gradients into their producer's, the loss gives a layer unit's aux outputs'),
    then its flat unreduced gradient ((world, k, n); (world*n,) for a one-layer unit whose
    reduce is a reduce-scatter, (padded,) for a part that is not a stack), then
    ``Reducing`` (then ``Reduced`` until its update, ``fz3.train_step``)."""

    call: Call
    params: dict[int, Gathering | Pieces] = field(default_factory=dict)
    activation: dict[int, tuple] = field(default_factory=dict)
    grad: dict[int, Any] = field(default_factory=dict)
    # its outputs after h: a pre or between unit's extras as the layers after it take them
    # (``Produced``), a layer unit's aux outputs until the loss
    outputs: dict[int, Any] = field(default_factory=dict)
    # by part, the step's result: its gradient ``Shard``, or (``Schedule.join_grads``) its units'
    # reduced (k, shard) rows by first layer, joined at the step's end (``unit_io.joined``)
    results: dict[int, Shard | dict[int, torch.Tensor]] = field(default_factory=dict)
    replicating: list[Pending] = field(default_factory=list)  # hybrid: the shards' all-reduces
    # the activation flowing forward, and its gradient flowing back
    h: torch.Tensor | None = None
    grad_h: torch.Tensor | None = None
    loss: torch.Tensor | None = None  # this rank's loss
    aux: Any = None
    loss_mean: Pending | None = None
    rng_after: RngState | None = None  # the RNG as plain autograd would leave it

    def owned_bytes(self) -> tuple[int, int, int]:
        """Bytes of the buffers the step holds: gathered parameters, unreduced gradients,
        inputs kept for recompute (the memory plan predicts the same three, op by op)."""
        params = sum(nbytes(b) for p in self.params.values()
                     for b in ((q.out for q in p.pending()) if isinstance(p, Gathering)
                               else (p.buffer, p.frozen)) if b is not None)
        grads = sum(nbytes(g) if isinstance(g, torch.Tensor) else pending_bytes(g.pending)
                    for g in self.grad.values() if isinstance(g, (torch.Tensor, Reducing)))
        inputs = sum(nbytes(r.inputs[0]) for _, r in self.activation.values()
                     if type(r) is Replay)
        return params, grads, inputs

    def moved_bytes(self, op: Op) -> int:
        """Bytes a collective op moves (the full, unsharded buffer); 0 for other ops."""
        if op.kind == OpKind.GATHER:
            return sum(nbytes(p.out) for p in self.params[op.unit].pending())
        if op.kind == OpKind.REDUCE:
            return pending_bytes(self.grad[op.unit].pending)
        return 0

    def in_flight(self) -> list[Pending]:
        """Collectives issued and not waited for, in issue order per kind."""
        loss = [self.loss_mean] if self.loss_mean is not None else []
        return [*(p for g in self.params.values() if isinstance(g, Gathering)
                  for p in g.pending()),
                *(r.pending for r in self.grad.values() if isinstance(r, Reducing)),
                *self.replicating, *loss]

    def drain(self, wait: Callable[[Pending], Any]) -> None:
        """Wait for everything still in flight: a step that ends early (``step_through``
        stopped, an error) leaves the collective sequence the same on every rank."""
        for p in self.in_flight():
            wait(p)
        self.abandon([])

    def abandon(self, keep: list) -> None:
        """Forget everything in flight without waiting, its buffers kept alive in ``keep``
        (ranks are absent: nothing in flight will complete)."""
        keep.extend(self.in_flight())
        self.params.clear()  # the step is over: none of its records is read again
        self.grad.clear()
        self.replicating.clear()
        self.loss_mean = None


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def pending_bytes(p: Pending) -> int:
    """A reduce's full gradient: the reduce-scatter's input, or the all-reduce's buffer."""
    return nbytes(p.keep if p.keep is not None else p.out)
