"""The one protocol a layer unit's compute runs through, and its autograd implementation.

[Note: the layer protocol]
The executor calls a unit of a stack's layers only through three methods:

- ``forward(pieces, h, extras) -> (h, residuals)``: the unit's forward, keeping what its
  backward needs;
- ``inference(pieces, h, extras) -> h``: the forward alone (nothing kept: forward-only
  steps, and ``recompute``'s first forward, which runs ``forward`` again in backward from
  the saved input and RNG state);
- ``backward(pieces, residuals, g, extras) -> (grad_buffer, grad_h, grad_extras)``: the
  gradient of the unit's trained buffer (``Pieces.buffer``'s shape), of its input, and of
  each extra that carries gradient (``Produced.positions``' order, summed over its layers).

``pieces`` are the unit's gathered memory (``Pieces``), ``extras`` the record of the pre or
between unit whose extra outputs the layers take (``Produced``). Two implementations:
``fz3.step.traced.Layers`` (traced programs, compiled by inductor with ``compile=True``) and
``AutogradLayers`` below (the layer's Python through autograd: ``trace=False``, and layers
that cannot be traced). ``holds_buffer`` says whether residuals may view the gathered buffer
(then ``free`` keeps its storage object, ``fz3.step.executor``).

A later per-layer output with its own cotangent (an MoE router's statistics) is one more
element of ``h``'s side of the protocol: ``forward`` returns it beside ``h``, ``backward``
takes its cotangent beside ``g``; no new channel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import torch

from ..sharding import compute
from ..sharding.binding import Binding
from ..sharding.parts import Part


class Pieces(NamedTuple):
    """A layer unit's gathered memory."""

    buffer: torch.Tensor  # its trained buffer: (1, padded) for one layer, (k, padded) for k
    rows: tuple[torch.Tensor, ...]  # each layer's trained row, 1-D, as gathered
    frozen: torch.Tensor | None  # its frozen buffer, (k, frozen padded), or None


@dataclass(eq=False)
class Produced:
    """A pre or between unit's extra outputs, as the layers after it take them."""

    extras: tuple  # detached (rotary tables, masks, ...)
    positions: list[int]  # those that carry gradient
    traced: Any = None  # as traced programs take them (``fz3.step.traced.Extras``), made once
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # their gradients, summed


class Graph(NamedTuple):
    """``AutogradLayers``' residuals: the forward's autograd graph, by its ends."""

    out: torch.Tensor
    leaf: torch.Tensor  # aliasing the trained buffer
    x: torch.Tensor  # the input's leaf
    extras: tuple  # the extras as called (leaves where they carry gradient)


class AutogradLayers:
    """Layers ``first, ...`` of a stack part through autograd (see the module's Note)."""

    holds_buffer = True  # a graph holds views of the buffer

    def __init__(self, bindings: Sequence[Binding], part: Part, first: int, writes: dict):
        self.bindings, self.part, self.first, self.writes = tuple(bindings), part, first, writes

    def forward(self, pieces: Pieces, h: torch.Tensor, extras: Produced) -> tuple:
        leaf, x = compute.leaf(pieces.buffer), h.detach().requires_grad_()
        called = compute.detach_extras(extras.extras, extras.positions, grad=True)
        with torch.enable_grad():
            out = self._run(leaf, pieces.frozen, x, called)
        return out.detach(), Graph(out, leaf, x, called)

    def inference(self, pieces: Pieces, h: torch.Tensor, extras: Produced) -> torch.Tensor:
        with torch.no_grad():
            return self._run(pieces.buffer, pieces.frozen, h, extras.extras)

    def backward(self, pieces: Pieces, graph: Graph, g: torch.Tensor,
                 extras: Produced) -> tuple:
        wrt = [graph.leaf, graph.x, *(graph.extras[j] for j in extras.positions)]
        grads = torch.autograd.grad(graph.out, wrt, g, allow_unused=True)
        return grads[0], grads[1], grads[2:]

    def _run(self, buffer: torch.Tensor, frozen: torch.Tensor | None, h: torch.Tensor,
             extras: tuple) -> torch.Tensor:
        """The layers on ``h``, their parameters views of ``buffer`` (k, padded): a one-layer
        buffer's row is a view whose backward is free (unbind's stacks the rows' gradients)."""
        part = self.part
        rows = (buffer.view(-1),) if buffer.shape[0] == 1 else buffer.unbind(0)
        tensors = [part.layout.views(row) + ([] if frozen is None else part.frozen.views(frozen[j]))
                   for j, row in enumerate(rows)]
        return compute.run_layers(self.bindings, tensors, h, extras, part.path,
                                  part.first + self.first, self.writes)
