"""The one protocol a layer unit's compute runs through, and its autograd implementation.

[Note: the layer protocol]
The executor calls a unit of a stack's layers only through four methods:

- ``forward(pieces, h, extras) -> (h, aux, residuals)``: the unit's forward, keeping what its
  backward needs;
- ``inference(pieces, h, extras) -> (h, aux)``: the forward alone (nothing kept: forward-only
  steps, and ``recompute``'s first forward, which runs ``forward`` again in backward from
  the saved input and RNG state);
- ``backward(pieces, residuals, g, g_aux, extras, into) -> (grad_buffer, grad_h,
  grad_extras)``: the gradient of the unit's trained buffer (``(padded,)`` or ``(1, padded)``
  for one layer, ``(k, padded)`` for k), of its input, and of each extra that carries
  gradient (``Produced.positions``' order, summed over its layers); ``into``: the unit's
  gradient memory (``UnitMemory.grad_into``) the buffer's gradient may be written into and
  returned, or None;
- ``recompute(pieces, h, g, g_aux, extras, into)``: what ``backward`` returns for the
  residuals ``forward(pieces, h, extras)`` would keep (``recompute``'s backward, the
  forward's RNG restored first): traced programs run the unit's last layer's forward and
  backward as one program, which skips what only that layer's output needed.

``aux`` is the unit's layers' auxiliary outputs, ``(k, *shape)`` (``ShardedModel.layer_aux``:
every layer returns ``(h, aux)``, an MoE router's statistics), or None; ``g_aux`` its
cotangent from the loss (or None: the loss did not use it). ``pieces`` are the unit's
gathered memory (``Pieces``), ``extras`` the record of the pre or between unit whose extra
outputs the layers take (``Produced``). Two implementations:
``fz3.step.programs.Layers`` (traced programs, compiled by inductor with ``compile=True``) and
``AutogradLayers`` below (the layer's Python through autograd: ``trace=False``, and layers
that cannot be traced).

Pre, between and post units run through the first three (``Stage``): ``h`` is their
input (none for pre: the batch is theirs), ``extras`` the batch, ``forward`` returns their
outputs (``(h, extras)``, or post's ``(loss, aux)``) and keeps their graph, ``backward``
takes the cotangent of h (post: the loss's seed) and their extras' summed cotangents, and
returns one gradient per trained buffer they read (``StagePieces``), h's, and (post) the
gradients of the layers' aux outputs it was given (one per stack).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch

from ..schedule.saveable import save
from ..schedule.structure import Role
from ..sharding import compute
from ..sharding.binding import Binding
from ..sharding.parts import Part
from . import shapes


class Pieces(NamedTuple):
    """A unit's gathered memory (its ``StepState.params`` record): ``UnitMemory``'s
    tensors, the same every step."""

    # its trained buffer: a layer unit's (1, padded) for one layer, (k, padded) for k; any
    # other unit's (padded,)
    buffer: torch.Tensor
    rows: tuple[torch.Tensor, ...]  # a layer unit's: each layer's trained row, 1-D, as gathered
    frozen: torch.Tensor | None  # its frozen buffer ((k, frozen padded) for layers), or None
    frozen_rows: tuple[torch.Tensor, ...] = ()  # a layer unit's: each layer's frozen row, 1-D


class Produced(NamedTuple):
    """A pre or between unit's extra outputs, as the layers after it take them (their gradient
    sums: the unit's ``StepState.grad`` record until its backward)."""

    extras: tuple  # detached (rotary tables, masks, ...)
    positions: list[int]  # those that carry gradient
    traced: Any = None  # as traced programs take them (``fz3.step.programs.Extras``), made once


class Graph(NamedTuple):
    """``AutogradLayers``' residuals: the forward's autograd graph, by its ends."""

    out: torch.Tensor
    aux: torch.Tensor | None  # the layers' stacked aux outputs (``layer_aux``), or None
    leaf: torch.Tensor  # aliasing the trained buffer
    x: torch.Tensor  # the input's leaf
    extras: tuple  # the extras as called (leaves where they carry gradient)


class AutogradLayers:
    """Layers ``first, ...`` of a stack part through autograd (see the module's Note)."""

    # autograd keeps its graph (``fz3.step.programs.Layers.saves``): another predicate runs
    # as recompute (a staticmethod: the function itself, not a method bound to the engine)
    saves = staticmethod(save)

    def __init__(self, bindings: Sequence[Binding], part: Part, first: int, writes: dict,
                 aux: bool = False):
        self.bindings, self.part, self.first, self.writes = tuple(bindings), part, first, writes
        self.aux = aux

    def forward(self, pieces: Pieces, h: torch.Tensor, extras: Produced) -> tuple:
        leaf, x = compute.leaf(pieces.buffer), h.detach().requires_grad_()
        called = compute.detach_extras(extras.extras, extras.positions, grad=True)
        with torch.enable_grad():
            out, aux = self._run(leaf, pieces.frozen, x, called)
        return (out.detach(), None if aux is None else aux.detach(),
                Graph(out, aux, leaf, x, called))

    def inference(self, pieces: Pieces, h: torch.Tensor, extras: Produced) -> tuple:
        with torch.no_grad():
            return self._run(pieces.buffer, pieces.frozen, h, extras.extras)

    def backward(self, pieces: Pieces, graph: Graph, g: torch.Tensor,
                 g_aux: torch.Tensor | None, extras: Produced, into=None) -> tuple:
        """``into`` is not used: autograd makes the buffer's gradient."""
        wrt = [graph.leaf, graph.x, *(graph.extras[j] for j in extras.positions)]
        outputs, cotangents = [graph.out], [g]
        if g_aux is not None and graph.aux is not None and graph.aux.requires_grad:
            outputs.append(graph.aux)
            cotangents.append(g_aux)
        grads = torch.autograd.grad(outputs, wrt, cotangents, allow_unused=True)
        return grads[0], grads[1], grads[2:]

    def recompute(self, pieces: Pieces, h: torch.Tensor, g: torch.Tensor,
                  g_aux: torch.Tensor | None, extras: Produced, into=None) -> tuple:
        """``backward`` of ``forward`` run again from ``h`` (the RNG restored by the caller)."""
        return self.backward(pieces, self.forward(pieces, h, extras)[2], g, g_aux, extras, into)

    def _run(self, buffer: torch.Tensor, frozen: torch.Tensor | None, h: torch.Tensor,
             extras: tuple) -> tuple:
        """``(h, aux)``: the layers on ``h``, their parameters views of ``buffer`` (k, padded)."""
        part = self.part
        rows = shapes.leaf_rows(buffer)
        tensors = [part.layout.views(row) + ([] if frozen is None else part.frozen.views(frozen[j]))
                   for j, row in enumerate(rows)]
        return compute.run_layers(self.bindings, tensors, h, extras, part.path,
                                  part.first + self.first, self.writes, self.aux)


class StagePieces(NamedTuple):
    """A pre, between or post unit's gathered memory."""

    # its trained buffer, then those of the shared units it reads (``Unit.reads``' order)
    trained: tuple[torch.Tensor, ...]
    # views(trained or leaves of them) -> what its function is called with (frozen ones too)
    views: Callable[[Sequence[torch.Tensor] | None], list[torch.Tensor]]


class StageGraph(NamedTuple):
    """``Stage``'s residuals: its graph, by its ends."""

    x: torch.Tensor | None  # its input's leaf (None for pre)
    out: tuple  # (h, extras), or post's (loss, aux)
    leaves: tuple[torch.Tensor, ...]  # aliasing ``StagePieces.trained``
    layer_aux: tuple = ()  # post: the layers' aux outputs it was given, as leaves (one per stack)


class Stage:
    """Pre, a between function or the loss (post) through autograd (see the module's Note).
    Its graph is kept whenever gradients are wanted: pre's decides which extras (rotary
    tables, masks, ...) carry gradient, and costs one activation."""

    def __init__(self, binding: Binding, role: Role, name: str, has_aux: bool = False):
        self.binding, self.role, self.name, self.has_aux = binding, role, name, has_aux

    def forward(self, pieces: StagePieces, h: torch.Tensor | None, batch: Any,
                layer_aux: tuple | None = None) -> tuple:
        """``layer_aux`` (post, ``ShardedModel.layer_aux``): the layers' aux outputs, one
        ``(layers, *shape)`` tensor per stack, handed to the loss (and differentiated)."""
        leaves = tuple(compute.leaf(b) for b in pieces.trained)
        x = None if self.role is Role.PRE else h.detach().requires_grad_()
        aux = None if layer_aux is None else tuple(compute.leaf(a) for a in layer_aux)
        with torch.enable_grad():
            out = self._run(pieces.views(leaves), x, batch, aux)
        return out, StageGraph(x, out, leaves, () if aux is None else aux)

    def inference(self, pieces: StagePieces, h: torch.Tensor | None, batch: Any,
                  layer_aux: tuple | None = None) -> tuple:
        with torch.no_grad():
            return self._run(pieces.views(None), h, batch, layer_aux)

    def backward(self, pieces: StagePieces, graph: StageGraph, g: torch.Tensor,
                 extras: Produced | None = None, sums: dict | None = None) -> tuple:
        """``(one gradient per trained buffer, h's, the layer aux outputs')``: through its
        outputs that require grad and have a cotangent (``g`` for h or the loss; ``sums``,
        by position, for its ``extras``)."""
        first, rest = graph.out
        if self.role is Role.POST and not first.requires_grad:
            raise RuntimeError(f"{self.name} returned a loss that does not require grad (it was "
                               f"detached, or computed from no parameter and not from h): "
                               f"there is nothing to differentiate")
        cotangents = [(first, g)] + ([] if not sums else
                                     [(rest[j], sums.get(j)) for j in extras.positions])
        outputs = [(t, c) for t, c in cotangents if t.requires_grad and c is not None]
        wrt = [*graph.leaves, *(() if graph.x is None else (graph.x,)), *graph.layer_aux]
        grads = (torch.autograd.grad([t for t, _ in outputs], wrt, [c for _, c in outputs],
                                     allow_unused=True)
                 if outputs else (None,) * len(wrt))
        n, m = len(graph.leaves), len(graph.leaves) + (graph.x is not None)
        return grads[:n], (None if graph.x is None else grads[n]), grads[m:]

    def _run(self, tensors: list[torch.Tensor], x: torch.Tensor | None, batch: Any,
             layer_aux: tuple | None) -> tuple:
        if self.role is Role.POST:
            return compute.run_loss(self.binding, self.has_aux, tensors, x, batch, self.name,
                                    layer_aux)
        args = (batch,) if self.role is Role.PRE else (x, batch)
        return compute.run_stage(self.binding, tensors, args, self.name)
