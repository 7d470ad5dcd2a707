"""Inductor for traced layer programs (``compile=True``): each program compiled at its first
call, once per program and argument signature, so layers that share programs share the
compilation (C++ on the CPU, ``cpp_wrapper``: no Python between its kernels). A program
inductor fails on runs as Python with a WARNING (``fz3.comm.say``), or raises ``CompileError`` with
``strict``."""

from __future__ import annotations

import logging
from logging import WARNING
from typing import Any, Callable

import torch

from ..comm.say import once
from .joint import Programs
from .partition import unread_random

log = logging.getLogger(__name__)


class CompileError(RuntimeError):
    """``compile=True, strict=True`` and a traced program inductor cannot compile."""


def refuse_uncompiled(strict: bool, why: str) -> None:
    """``compile=True, strict=True`` (``strict``) means compiled or an error: a layer that
    would run through autograd (``why``) raises ``CompileError`` naming it. Local: every rank
    traces the same layers and fails alike, at construction or at the step's first call."""
    if strict:
        raise CompileError(f"fz3: compile=True, strict=True, but {why[:1500]}: it would run "
                           f"through autograd, not compiled. Make the layer traceable "
                           f"(step.traced.failed lists what stops a trace), or pass "
                           f"strict=False to run it through autograd with a warning")


class Kernels:
    """Inductor's compilations of traced programs, shared by every layer whose programs they
    are. ``strict``: a program inductor fails on raises ``CompileError``."""

    def __init__(self, *, strict: bool = False):
        self.strict, self.compiles = strict, 0  # compilations so far
        self._kernels: dict[tuple, Callable[..., Any]] = {}  # (graph, signature) -> compiled

    def compiled(self, programs: Programs, name: str) -> Programs:
        """``programs`` whose programs are compiled at their first call (``save`` runs the
        forward and backward, a one-layer recompute unit the inference and recompute, a
        k-layer one all four); ``name`` the layer they were traced from (for messages). A
        joined graph with a random draw nothing reads gets no recompute program (inductor
        would drop that draw and shift the later ones): its recompute runs forward, then
        backward."""
        fwd, bwd, inf, rec = programs.graphs
        joined = None if rec is None or unread_random(rec) else \
            _Inductor(self, rec, programs.recompute, f"{name}'s recompute", boxed=True)
        return programs._replace(
            forward=_Inductor(self, fwd, programs.forward, f"{name}'s forward"),
            backward=_Inductor(self, bwd, programs.backward, f"{name}'s backward", boxed=True),
            inference=_Inductor(self, inf, programs.inference, f"{name}'s inference"),
            recompute=joined,
            backward_into=None, recompute_into=None)  # their flat gradients are inductor's

    def kernel(self, graph: torch.fx.Graph, args: tuple, python: Callable[..., Any],
               name: str = "a layer's") -> Callable[..., Any]:
        """Inductor's compilation of ``graph`` for ``args``, one for every layer sharing these
        programs. One inductor fails on raises ``CompileError`` with ``strict`` (one line:
        ``name``, the program, inductor's first line and the fix; its whole text is the
        ``__cause__``); otherwise it warns and the program runs as ``python``."""
        key = (graph, tuple((tuple(a.shape), a.stride(), a.dtype) for a in args))
        if key not in self._kernels:
            from torch._inductor import compile as inductor_compile

            self.compiles += 1
            module = torch.fx.GraphModule({}, graph)
            try:
                self._kernels[key] = inductor_compile(module, list(args),
                                                      options={"cpp_wrapper": True})
            except Exception as e:  # noqa: BLE001 - inductor fails in many ways; each is reported
                first = str(e).splitlines()[0][:200] if str(e) else ""
                why = (f"inductor cannot compile {name} traced program: "
                       f"{type(e).__name__}: {first}")
                if self.strict:
                    raise CompileError(f"fz3: {why}. Pass compile=False, or strict=False to run "
                                       f"it as Python") from e
                once(log, WARNING, "fz3: %s; it runs as Python (strict=True raises)", why)
                self._kernels[key] = _FAILED
        got = self._kernels[key]
        return python if got is _FAILED else got


class _Inductor:
    """A traced graph, compiled by inductor at its first call (its arguments are the example:
    compiling runs nothing, so no RNG is drawn); ``python``, the same program as Python."""

    def __init__(self, owner: Kernels, graph: torch.fx.Graph, python: Callable[..., Any],
                 name: str, boxed: bool = False):
        self.owner, self.graph, self.python, self.boxed = owner, graph, python, boxed
        self.name, self.fn, self.native = name, None, False

    def __call__(self, *args: Any, made: dict | None = None) -> Any:
        if self.fn is None:
            example = tuple(args[0]) if self.boxed else args
            self.fn = self.owner.kernel(self.graph, example, self.python, self.name)
            self.native = self.fn is self.python
            del example
        if self.native:  # inductor failed: the Python program, in its own convention (the
            return self.fn(*args, made=made)  # backward's list, emptied as each residual is
        if self.boxed:  # last used); inductor's: the arguments (they live to the end here)
            (box,) = args
            args = tuple(box)
            box.clear()
        return self.fn(*args)


_FAILED = object()  # a program inductor could not compile: each caller runs its own Python


