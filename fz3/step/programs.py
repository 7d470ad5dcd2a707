"""A unit's traced programs behind the layer protocol (``Layers``), and what programs are
specialized to (``Extras``, ``Signature``). ``fz3.step.traced.TracedLayers`` makes them."""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import shapes
from .engine import Pieces, Produced
from .joint import Programs


class Layers(NamedTuple):
    """The programs of a unit's layers: the layer protocol (``fz3.step.engine``) over them.
    No autograd here: the programs get gathered buffers, detached activations and detached
    extras, none of which requires grad, so nothing records a graph."""

    programs: tuple[Programs, ...]  # one per layer of the unit
    # a residual may view the gathered buffer: ``free`` keeps its storage object (released)
    holds_buffer: bool
    # selective recompute: the ops whose outputs ``forward`` keeps (``fz3.step.partition``);
    # None: it keeps what autograd would
    keep: frozenset[str] | None = None

    def forward(self, pieces: Pieces, h: torch.Tensor, extras: Produced) -> tuple:
        """``(h, residuals)``: residuals a list, one tuple per layer, in layer order."""
        tensors, frozen, residuals = extras.traced.tensors, pieces.frozen, []
        for j, (programs, row) in enumerate(zip(self.programs, pieces.rows)):
            out = programs.forward(*((row,) if frozen is None else (row, frozen[j])), h,
                                   *tensors)
            h = out[0]
            residuals.append(out[1:])
        return h, residuals

    def inference(self, pieces: Pieces, h: torch.Tensor, extras: Produced) -> torch.Tensor:
        tensors, frozen = extras.traced.tensors, pieces.frozen
        for j, (programs, row) in enumerate(zip(self.programs, pieces.rows)):
            h = programs.inference(*((row,) if frozen is None else (row, frozen[j])), h,
                                   *tensors)[0]
        return h

    def backward(self, pieces: Pieces, residuals: list, g: torch.Tensor,
                 extras: Produced) -> tuple:
        """Last layer first; the buffer's gradient is ``(padded,)`` for one layer, ``(k,
        padded)`` for k. Empties ``residuals``: each is freed inside its program after its
        last use."""
        rows, frozen, k = pieces.rows, pieces.frozen, len(self.programs)
        grads: list = [None] * k
        summed: list = []
        for j in reversed(range(k)):
            params = [rows[j]] if frozen is None else [rows[j], frozen[j]]
            out = self.programs[j].backward([*params, *residuals.pop(), g])
            grads[j], g = out[0], out[1]
            summed = list(out[2:]) if not summed else [a + b for a, b in zip(summed, out[2:])]
        return shapes.buffer_grad(grads), g, summed


class Extras(NamedTuple):
    """A pre or between unit's extra outputs as the traced programs take them, made once per
    step (``TracedLayers.extras``): every layer after that unit reads the same ones."""

    tensors: tuple[torch.Tensor, ...]  # the tensors among them, flattened: the programs' inputs
    flat: list  # each extra flattened, ``(leaves, spec)``
    diff: tuple[int, ...]  # positions in ``tensors`` whose gradient the backward returns
    # what programs are specialized to (the tensors' shapes, strides and dtypes, the other
    # values); None: a value cannot be hashed, so the layers are not traced
    consts: tuple | None
    key: int  # ``consts``' number in this ``TracedLayers`` (a cheap per-layer lookup)


class Signature(NamedTuple):
    """What a layer's programs are specialized to."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    training: bool
    extras: tuple  # ``Extras.consts``
    keep: frozenset[str] | None  # ``Layers.keep``
