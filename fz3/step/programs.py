"""A unit's traced programs behind the unit protocol (``Layers``), and what programs are
specialized to (``Extras``, ``Signature``). ``fz3.step.traced.TracedLayers`` makes them.

[Note: programs run below autograd]
``Layers`` runs its programs with the dispatcher's autograd and ADInplaceOrView keys skipped
(``below_autograd``), as autograd's own kernels call the ops beneath them. Nothing is lost:
no input of a program requires grad, so no graph would be recorded, and what those keys do
besides is autograd's bookkeeping (a view's base and a version counter shared with it, an
in-place op's version bump) for graphs that could save these tensors. No graph does: a
program never writes into its inputs (refused when traced, and h is copied first,
``fz3.step.joint``), and its outputs reach autograd only detached (the loss's input, the
aux outputs stacked). What it saves is about a microsecond an op, most of it a view's
autograd metadata: 13% of ``save``'s host time a layer (``benchmarks/README.md``,
thirteenth stop). The tensors a program returns are not marked as views of each other
(``_base`` is None); nothing reads that. Inductor's compiled programs, which ``Layers`` calls
too, run below autograd as well; autograd-backed layers (``fz3.step.engine``) do not (they
record the graph their backward runs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import rng
from ..schedule.saveable import Saveable, save
from ..sharding.compute import stacked
from .engine import REPLAY, SAVED, Mode, Pieces, Produced, Replay
from .joint import Programs

# (``Layers`` enters it around its programs: [Note: programs run below autograd])
below_autograd = torch._C._AutoDispatchBelowADInplaceOrView


class Layers(NamedTuple):
    """The programs of a unit's layers: the unit protocol (``fz3.step.engine``) over them.
    No autograd here: the programs get gathered buffers, detached activations and detached
    extras, none of which requires grad, so nothing records a graph."""

    programs: tuple[Programs, ...]  # one per layer of the unit
    # the predicate its programs were cut by (``fz3.schedule.saveable``, ``fz3.step.partition``)
    saves: Saveable = save
    aux: bool = False  # each layer returns (h, aux) (``ShardedModel.layer_aux``)
    # [Note: inputs in their traced layout] The programs' views assume the strides they were
    # traced with (and inductor checks them): ``g_strides`` (h's shape, contiguous, as a
    # layer's backward usually hands g on) and ``h_strides`` (the unit's input's; None where
    # those are not dense). A g with others (a loss's gradient of a transposed read of h), or
    # a later layer's h with others (its predecessor's output), is copied into them first.
    # None: taken as it comes.
    g_strides: tuple | None = None
    h_strides: tuple | None = None
    # each layer's buffers, its programs' last inputs (``fz3.step.traced``): one tuple per
    # layer, empty where it has none (read as it is: no call on the per-layer path)
    buffers: tuple[tuple[torch.Tensor, ...], ...] = ()
    mode: Mode = SAVED  # ``fz3.step.engine``'s; ``SAVED``: residuals of programs cut by ``saves``

    def forward(self, memory, inputs: tuple) -> tuple:
        """Residuals (``SAVED``): a list, one tuple per layer, in layer order."""
        h, produced = inputs
        saving, pieces = self.mode == SAVED, memory.pieces
        state = rng.capture(h.device) if self.mode == REPLAY else None
        with below_autograd():
            tensors, frozen, residuals, auxes = produced.traced.tensors, pieces.frozen_rows, [], []
            buffers, made = self.buffers, pieces.made
            n = 2 if self.aux else 1  # the programs' outputs before their residuals
            for j, (programs, row) in enumerate(zip(self.programs, pieces.rows)):
                if j and self.h_strides is not None and h.stride() != self.h_strides:
                    h = laid_out(h, self.h_strides)
                out = (programs.forward if saving else programs.inference)(
                    *((row, frozen[j]) if frozen else (row,)), h, *tensors, *buffers[j],
                    made=made[j])
                h = out[0]
                if self.aux:
                    auxes.append(out[1])
                if saving:
                    residuals.append(out[n:])
            outputs = (h, stacked(auxes)) if self.aux else (h,)
            return outputs, (residuals if saving else
                             None if state is None else Replay(inputs, state))

    def backward(self, memory, residuals: list | Replay, cotangents: tuple) -> tuple:
        """Last layer first; the buffer's gradient is ``(padded,)`` for one layer, ``(k,
        padded)`` for k, written into the unit's gradient memory (``UnitMemory.grad_into``)
        where each layer's program can (``Programs.backward_into``). Empties ``residuals``:
        each is freed inside its program after its last use."""
        joined = type(residuals) is Replay
        if joined:
            # Nothing after the loss draws but recompute, which sets its own state; the
            # executor leaves the RNG as plain autograd would (``rng_after``).
            rng.restore(residuals.rng, residuals.inputs[0].device)
            residuals, joined = self._replay(memory.pieces, *residuals.inputs)
        with below_autograd():
            g, g_aux = cotangents[0], cotangents[1] if len(cotangents) > 1 else None
            pieces, into = memory.pieces, memory.grad_into()
            rows, frozen, made, k = pieces.rows, pieces.frozen_rows, pieces.made, len(self.programs)
            if self.aux and g_aux is None:
                shape, dtype = self.programs[0].aux
                g_aux = torch.zeros(k, *shape, dtype=dtype, device=g.device)
            elif self.aux:  # its rows as the programs' aux cotangent was traced: contiguous
                g_aux = g_aux.contiguous()
            grads: list = [None] * k
            summed: list = []
            written = 0
            want = self.g_strides
            for j in reversed(range(k)):
                if want is not None and g.stride() != want:
                    g = laid_out(g, want)
                box = [rows[j], frozen[j], *residuals.pop(), g] if frozen else \
                    [rows[j], *residuals.pop(), g]
                if self.aux:
                    box.append(g_aux[j])
                programs = self.programs[j]
                if joined and j == k - 1:
                    run, run_into = programs.recompute, programs.recompute_into
                else:
                    run, run_into = programs.backward, programs.backward_into
                if into is None or run_into is None:
                    out = run(box, made=made[j])
                else:
                    out = run_into(box, into[1][j], made[j])
                    written += 1
                grads[j], g = out[0], out[1]
                summed = list(out[2:]) if not summed else [a + b for a, b in zip(summed, out[2:])]
            grad = into[0] if written == k else grads[0] if k == 1 else torch.stack(grads)
            return (grad,), (g, summed)

    def _replay(self, pieces: Pieces, h: torch.Tensor, produced: Produced) -> tuple:
        """``(residuals, joined)`` for ``backward``, from the unit's input ``h`` (the
        forward's RNG restored): the last layer's forward and backward as one program
        (``Programs.recompute``: what only its output needed is not computed, no residual
        tuple: its entry is its inputs), the layers before it forward; without that
        program, every layer's forward."""
        joined = self.programs[-1].recompute is not None
        tensors, frozen, residuals = produced.traced.tensors, pieces.frozen_rows, []
        buffers, n = self.buffers, 2 if self.aux else 1
        with below_autograd():
            for j, (programs, row) in enumerate(zip(self.programs, pieces.rows)):
                if j and self.h_strides is not None and h.stride() != self.h_strides:
                    h = laid_out(h, self.h_strides)
                if joined and j == len(self.programs) - 1:
                    break
                out = programs.forward(*((row, frozen[j]) if frozen else (row,)), h, *tensors,
                                       *buffers[j], made=pieces.made[j])
                h = out[0]
                residuals.append(out[n:])
                del out
        if joined:
            residuals.append((h, *tensors, *buffers[-1]))  # the last layer's inputs
        return residuals, joined


def laid_out(t: torch.Tensor, stride: tuple) -> torch.Tensor:
    """A copy of ``t`` with ``stride``: the layout a program was traced for ([Note: inputs in
    their traced layout])."""
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


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
    saves: Saveable  # ``Layers.saves``
