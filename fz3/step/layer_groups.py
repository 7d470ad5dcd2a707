"""Which layers of a stack may share traced programs: those whose modules hold the same
Python state (``fz3.step.traced``). ``groups`` numbers them; ``_state`` is the comparable key
of what a layer's code reads besides its parameters and inputs."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..sharding.binding import Binding
from ..sharding.parts import Part
from .codegen import TraceError


def groups(bindings: Sequence[Binding], part: Part, failed: dict[str, str]) -> list[int]:
    """Layer -> group: layers in one group hold the same Python state. Records in ``failed``
    a part whose layers hold state a trace cannot see (buffers, hooks, shared reads)."""
    keys: dict[tuple, int] = {}
    out = []
    for layer, binding in enumerate(bindings):
        try:
            key = _state(binding)
        except TraceError as e:
            failed[part.name] = f"layer {part.path}.{part.first + layer} cannot be traced: {e}"
            return []
        out.append(keys.setdefault(key, len(keys)))
    if part.reads:
        failed[part.name] = f"{part.name} reads shared parameters"
    return out


def _state(binding: Binding) -> tuple:
    """What a layer's code can read besides its parameters and inputs, as a comparable key."""
    items: list[Any] = [id(binding.module.fn)]
    for path, module in binding.module.m.named_modules():
        if any(b is not None for b in module._buffers.values()):
            raise TraceError(f"{path or 'it'} has buffers (state a trace would freeze)")
        state = []
        for k, v in vars(module).items():
            if k in _MODULE_OWN:  # nn.Module's own tables: only hooks matter to a trace
                if v and "hook" in k and ("forward" in k or "backward" in k) and \
                        not isinstance(v, bool):
                    raise TraceError(f"{path or 'it'} has hooks ({k}), which a trace would skip")
                continue
            state.append((k, v if _plain(v) else ("id", id(v))))
        items.append((path, type(module), tuple(state)))
    return tuple(items)


_MODULE_OWN = frozenset(vars(torch.nn.Module()))


def _plain(v: Any) -> bool:
    if isinstance(v, (tuple, frozenset)):
        return all(_plain(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str, torch.dtype))
