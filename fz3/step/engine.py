"""The one protocol every unit's compute runs through, and its autograd implementation.

[Note: the unit protocol]
The executor runs every unit (pre, a between function, a stack's layers, the loss) through
two methods of its engine:

- ``forward(memory, inputs) -> (outputs, residuals)``
- ``backward(memory, residuals, cotangents) -> (param_grads, input_grads)``

``memory`` is the unit's ``UnitMemory`` (a layer unit's) or the tuple of its own and those of
the shared units it reads (``Unit.reads``); engines read its gathered ``pieces`` at call
time. ``inputs`` is ``(h, batch)`` (pre: ``(None, batch)``; the loss: ``(h, batch,
stacked_aux)``, ``stacked_aux`` the layers' aux outputs, one per stack, or None) or, for a
layer unit, ``(h, produced)`` (``Produced``: its producer's extra outputs). ``outputs`` is
``(h, *extras)`` (pre, between), ``(h,)`` or ``(h, aux)`` (layers, ``layer_aux``) or ``(loss,
aux)``, detached. ``cotangents`` is aligned with ``outputs`` (shorter, or None inside: no
cotangent); ``param_grads``: one per trained buffer of ``memory`` (None: zeros);
``input_grads``: aligned with ``inputs``, h's zero-filled, a ``Produced``'s one per position
that carries gradient, the stacks' aux one per stack, None for what is not differentiated.

An engine's ``mode`` (``Mode``), fixed when it is made, says what its forward keeps: ``SAVED``
(its residuals: autograd's graph, or what a predicate saves of traced programs), ``REPLAY``
(``recompute``: ``Replay``, the inputs and RNG state, its backward runs the forward again)
or ``INFER`` (nothing: a forward-only unit). The residuals decide the backward, never the
executor. Two implementations: ``AutogradUnit`` below (every pre, between and loss unit;
layers with ``trace=False`` or that cannot be traced) and ``fz3.step.programs.Layers``
(traced programs, compiled by inductor with ``compile=True``). An aux output's cotangent the
loss did not give is zeros inside ``Layers`` (autograd leaves the output out): never in the
executor, where autograd through a zero cotangent could differ (``0 * inf``).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable, NamedTuple

import torch

from .. import rng
from ..rng import RngState
from ..sharding import compute


class Mode(Enum):
    """An engine's mode: what its forward keeps for its backward."""

    SAVED = "saved"  # its residuals
    REPLAY = "replay"  # what runs the forward again (``Replay``)
    INFER = "infer"  # nothing: no backward follows


SAVED, REPLAY, INFER = Mode.SAVED, Mode.REPLAY, Mode.INFER


class Pieces(NamedTuple):
    """A unit's gathered memory (its ``StepState.params`` record): ``UnitMemory``'s
    tensors, the same every step."""

    # its trained buffer: a layer unit's (1, padded) for one layer, (k, padded) for k; any
    # other unit's (padded,)
    buffer: torch.Tensor
    rows: tuple[torch.Tensor, ...]  # a layer unit's: each layer's trained row, 1-D, as gathered
    frozen: torch.Tensor | None  # its frozen buffer ((k, frozen padded) for layers), or None
    frozen_rows: tuple[torch.Tensor, ...] = ()  # a layer unit's: each layer's frozen row, 1-D
    # a layer unit's: each layer's parameter views, kept by its programs (``made``,
    # ``fz3.step.views.RowViews``)
    made: tuple[dict, ...] = ()


class Produced(NamedTuple):
    """A pre or between unit's extra outputs, as the layers after it take them."""

    extras: tuple  # detached (rotary tables, masks, ...)
    positions: list[int]  # those that carry gradient
    traced: Any = None  # as traced programs take them (``fz3.step.programs.Extras``), made once


class Graph(NamedTuple):
    """``AutogradUnit``'s residuals: the forward's autograd graph, by its ends."""

    outputs: tuple  # as autograd made them
    leaves: tuple[torch.Tensor, ...]  # aliasing the trained buffers
    inputs: tuple  # the inputs as called (leaves where they are differentiated)


class Replay(NamedTuple):
    """``REPLAY``'s residuals: what the backward runs the forward again from."""

    inputs: tuple
    rng: RngState  # the RNG state before (dropout draws the same)


class AutogradUnit:
    """A unit through autograd (see the module's Note): ``run(tensors, inputs) -> outputs``
    its function; ``trained(memory)`` its trained buffers, ``views(memory, trained)`` the
    tensors ``run`` takes, views of ``trained`` (or of leaves aliasing them)."""

    def __init__(self, run: Callable, trained: Callable, views: Callable, mode: Mode,
                 device: torch.device):
        self.run, self.trained, self.views = run, trained, views
        self.mode, self.device = mode, device

    def forward(self, memory, inputs: tuple) -> tuple:
        if self.mode == SAVED:
            return self._record_graph(memory, inputs)
        state = rng.capture(self.device) if self.mode == REPLAY else None
        with torch.no_grad():
            outputs = self.run(self.views(memory, self.trained(memory)), inputs)
        return outputs, (None if state is None else Replay(inputs, state))

    def _record_graph(self, memory, inputs: tuple) -> tuple:
        leaves = tuple(compute.leaf(b) for b in self.trained(memory))
        called = tuple(_leaves(x, i) for i, x in enumerate(inputs))
        with torch.enable_grad():
            outputs = self.run(self.views(memory, leaves), called)
        return (tuple(o.detach() if isinstance(o, torch.Tensor) and o.requires_grad else o
                      for o in outputs), Graph(outputs, leaves, called))

    def backward(self, memory, residuals: Graph | Replay, cotangents: tuple) -> tuple:
        if type(residuals) is Replay:
            # Nothing after the loss draws but recompute, which sets its own state; the
            # executor leaves the RNG as plain autograd would (``rng_after``).
            rng.restore(residuals.rng, self.device)
            residuals = self._record_graph(memory, residuals.inputs)[1]
        pairs = [(o, c) for o, c in zip(residuals.outputs, cotangents)
                 if c is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        inputs = residuals.inputs
        wrt = [*residuals.leaves, *(t for i, x in enumerate(inputs) for t in _wrt(x, i))]
        grads = (torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs],
                                     allow_unused=True) if pairs else (None,) * len(wrt))
        n = len(residuals.leaves)
        params, rest, out = grads[:n], iter(grads[n:]), []
        for i, x in enumerate(inputs):
            got = tuple(next(rest) for _ in _wrt(x, i))
            out.append(or_zeros(got[0], x) if i == 0 and x is not None else got or None)
        return params, tuple(out)


def _leaves(x: Any, i: int) -> Any:
    """Input ``i`` as the forward differentiates it: h an autograd leaf, a ``Produced``'s
    extras that carry gradient leaves, the stacks' aux outputs leaves; the batch as it is."""
    if x is None or i == 1 and not isinstance(x, Produced):
        return x
    if i == 0:
        return x.detach().requires_grad_()
    if i == 1:
        return x._replace(extras=compute.detach_extras(x.extras, x.positions, grad=True))
    return tuple(a.detach().requires_grad_() for a in x)


def _wrt(x: Any, i: int) -> tuple:
    """The leaves ``_leaves`` made of input ``i``."""
    if x is None or i == 1 and not isinstance(x, Produced):
        return ()
    if i == 0:
        return (x,)
    return tuple(x.extras[j] for j in x.positions) if i == 1 else x


def or_zeros(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g
