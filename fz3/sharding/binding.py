"""How a function of the model receives its parameters: a lean ``functional_call``.

``torch.func.functional_call`` substitutes tensors for a module's parameters for one call;
it looks every name up again on every call (about 30 us for a transformer layer's dozen
parameters on a CPU core, more than the layer's own math at small sizes: the host cost the
seeds warn about). The skeleton is fz3's own copy of the module, whose parameters are meta
placeholders nobody else uses, so the lookup is done once here: ``Binding`` keeps the
(module, attribute) of every parameter name, sets the gathered views into those modules'
parameter tables for the call, and puts the placeholders back after it, exactly what
``functional_call`` does per call. Compiled functions keep ``functional_call``: it is traced
once and costs nothing per call.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call

from .layout import FlatLayout


class BoundFunction(nn.Module):
    """Calls ``fn(m, *args)``; lets ``functional_call`` substitute ``m``'s parameters (names
    ``m.*``)."""

    def __init__(self, fn: Callable[..., Any], m: nn.Module):
        super().__init__()
        self.fn = fn
        self.m = m

    def forward(self, *args: Any) -> Any:
        return self.fn(self.m, *args)


class Binding:
    """``fn(m, *args)`` with the parameters of ``layouts`` (in order, one tensor per slot)."""

    def __init__(self, fn: Callable[..., Any], m: nn.Module, layouts: Sequence[FlatLayout]):
        self.module = BoundFunction(fn, m)
        names, index = [], []
        for i, s in enumerate(s for layout in layouts for s in layout.slots):
            names += s.names
            index += [i] * len(s.names)
        self.names = ["m." + n for n in names]
        self.index = index
        self.slots = sum(len(layout.slots) for layout in layouts)
        self.targets = _targets(m, names)
        self.placeholders = (None if self.targets is None
                             else [o._parameters[a] for o, a in self.targets])

    def __call__(self, tensors: Sequence[torch.Tensor], args: tuple) -> Any:
        if self.targets is None:  # a module this binding cannot see through: functional_call does
            bound = {n: tensors[i] for n, i in zip(self.names, self.index)}
            return functional_call(self.module, bound, args, tie_weights=False)
        for (owner, attr), i in zip(self.targets, self.index):
            owner._parameters[attr] = tensors[i]
        try:
            return self.module.fn(self.module.m, *args)
        finally:
            for (owner, attr), placeholder in zip(self.targets, self.placeholders):
                owner._parameters[attr] = placeholder

    def rebound(self, layouts: Sequence[FlatLayout]) -> "Binding":
        """The same function and module, called with the parameters of ``layouts``."""
        return Binding(self.module.fn, self.module.m, layouts)

    def traced(self, tensors: Sequence[torch.Tensor], args: tuple) -> Any:
        """The same call through ``functional_call`` (for ``torch.compile`` to trace)."""
        bound = {n: tensors[i] for n, i in zip(self.names, self.index)}
        return functional_call(self.module, bound, args, tie_weights=False)


def _targets(m: nn.Module, names: Sequence[str]) -> list[tuple[nn.Module, str]] | None:
    """The (module, attribute) holding each parameter name, or None if one is not a plain entry
    of a module's parameter table (a parametrization, say)."""
    out = []
    for name in names:
        path, _, attr = name.rpartition(".")
        try:
            owner = m.get_submodule(path)
        except AttributeError:
            return None
        if attr not in owner._parameters or type(owner).__getattr__ is not nn.Module.__getattr__:
            return None
        out.append((owner, attr))
    return out
