"""Compiled layers: one ``torch.compile`` of the pure per-layer function, reused by every layer
of a stack. With ``trace=True`` (the default) this is the fallback for layers that cannot be
traced (``fz3.step.traced`` compiles traced ones with inductor directly); with
``trace=False`` it compiles every stack.

Every layer of a stack is the same function of (its flat row of parameters, h, extras): the
row's split into parameter views and the layer's math are traced once, so a call costs a
guard check instead of a dozen name lookups and a hundred dispatches, and its backward (the
recompute's too) is one compiled graph whose gradient w.r.t. the row is already flat. The
layer's module is an argument, not a constant, so one graph serves every layer; something
that differs per layer and that the layer's code reads (a layer index, say) would make
dynamo compile again per layer, which is reported, not silently slow.

A layer function that cannot be compiled (a graph break, an unsupported op) falls back to
eager with one warning naming the part and the reason, unless ``strict`` asked for it to
raise. Compiled kernels sum in another order than eager ones: results equal eager within
rtol 1e-4 (see ``tests/test_compiled.py``).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Sequence

import torch
from torch.func import functional_call

from ..schedule.structure import Role
from ..sharding.binding import Binding
from ..sharding.parts import Part

log = logging.getLogger(__name__)


class CompileError(RuntimeError):
    """``compile=True, strict=True`` and a layer function that cannot be compiled."""


class CompiledLayers:
    """Per stack part, a compiled ``(module, row, frozen row, h, *extras) -> h``; eager where
    compilation failed (and ``strict`` is off)."""

    def __init__(self, parts: Sequence[Part], *, strict: bool, **options: Any):
        self.strict = strict
        self.functions: dict[int, Callable[..., torch.Tensor]] = {}
        self.failed: dict[int, str] = {}  # part -> why it runs eager
        self.graphs: dict[tuple[int, bool], int] = {}  # (part, grad mode) -> graphs compiled so far
        self.warned: set[int] = set()
        for i, part in enumerate(parts):
            if part.role is Role.STACK:
                # fullgraph: a graph break is a layer that cannot be compiled whole, reported (or
                # raised with ``strict``) instead of left to run as several small graphs.
                self.functions[i] = torch.compile(_layer_function(part), dynamic=False,
                                                  fullgraph=True, **options)

    def __call__(self, part_index: int, part: Part, binding: Binding, row: torch.Tensor,
                 frozen_row: torch.Tensor | None, h: torch.Tensor, extras: tuple,
                 name: object) -> torch.Tensor:
        fn = self.functions.get(part_index)
        if fn is None or part_index in self.failed:
            return _eager(part, binding, row, frozen_row, h, extras)
        before = _graphs()
        try:
            out = fn(binding.module, row, frozen_row, h, *extras)
        except Exception as e:  # noqa: BLE001 - compilation can fail in many ways; each is reported
            if self.strict:
                raise CompileError(f"{name} ({part.name}) cannot be compiled: {e}. "
                                   f"Pass compile=False, or strict=False to run it eager") from e
            self.failed[part_index] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            warnings.warn(f"fz3: the layer function of {part.name} cannot be compiled; it runs "
                          f"eager. Reason: {self.failed[part_index]}", stacklevel=4)
            return _eager(part, binding, row, frozen_row, h, extras)
        self._note_compiles(part_index, part, torch.is_grad_enabled(), _graphs() - before, name)
        return out

    def _note_compiles(self, i: int, part: Part, grad: bool, new: int, name: object) -> None:
        """One graph per part and grad mode is expected; more means a guard that differs per
        layer (reported once)."""
        key = (i, grad)
        self.graphs[key] = self.graphs.get(key, 0) + new
        if self.graphs[key] > 1 and i not in self.warned:
            self.warned.add(i)
            warnings.warn(f"fz3: the compiled layer function of {part.name} compiled again at "
                          f"{name}: something its code reads differs per layer (an attribute "
                          f"such as a layer index?), so every layer compiles on its own and runs "
                          f"slowly. Make the layers identical, or pass compile=False", stacklevel=4)


def check_compile_options(model: Any, compile: bool, strict: bool, cuda_graphs: bool) -> None:
    """Local, before any collective: what ``compile``/``cuda_graphs`` can run here."""
    if strict and not compile:
        raise ValueError("strict=True asks compile=True to raise instead of falling back to "
                         "eager; pass compile=True with it")
    if cuda_graphs and model.device.type != "cuda":
        raise ValueError(f"cuda_graphs=True replays CUDA graphs, and the model is on "
                         f"{model.device}: graph capture needs a CUDA device (shard onto one, or "
                         f"drop cuda_graphs; compile=True runs on the CPU too)")


def _layer_function(part: Part) -> Callable[..., torch.Tensor]:
    """The pure function of one layer of ``part``: its row of parameters (and frozen ones), h
    and extras -> h. The layout is a constant of it; the module an argument."""
    trained, frozen = part.layout, part.frozen

    def layer(module: torch.nn.Module, row: torch.Tensor, frozen_row: torch.Tensor | None,
              h: torch.Tensor, *extras: Any) -> torch.Tensor:
        bound = trained.named_views(row, prefix="m.")
        if frozen is not None:
            bound.update(frozen.named_views(frozen_row, prefix="m."))
        return functional_call(module, bound, (h, *extras), tie_weights=False)

    return layer


def _eager(part: Part, binding: Binding, row: torch.Tensor, frozen_row: torch.Tensor | None,
           h: torch.Tensor, extras: tuple) -> torch.Tensor:
    tensors = part.layout.views(row) + ([] if frozen_row is None
                                        else part.frozen.views(frozen_row))
    return binding(tensors, (h, *extras))


def _graphs() -> int:
    """Graphs dynamo has compiled in this process (``torch._dynamo``'s own counter)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
