"""A layer's buffers as inputs of its traced programs (``fz3.step.traced``): where each is
held (``owners``), and the layer's function run with the trace's tensors in their place
(``substituted``), as ``fz3.sharding.binding`` puts gathered parameters into the skeleton.
A buffer is read, never written: a layer that assigns one anew is not traced (one written in
place is refused with every other input, ``fz3.step.joint``)."""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import nn

from ..sharding.binding import Binding
from .codegen import TraceError


def owners(binding: Binding) -> tuple[tuple[nn.Module, str], ...]:
    """``(module, name)`` of each buffer of a layer's modules: its programs' last inputs."""
    return tuple((module, name) for _, module in binding.module.m.named_modules()
                 for name, b in module._buffers.items() if b is not None)


def values(binding: Binding) -> tuple[torch.Tensor, ...]:
    """The layer's buffers, in ``owners``' order (the skeleton's: fz3's own copy)."""
    return tuple(module._buffers[name] for module, name in owners(binding))


@contextlib.contextmanager
def substituted(held: Sequence[tuple[nn.Module, str]],
                tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """The buffers ``held`` replaced by ``tensors`` while inside, restored after; a buffer
    the layer assigned anew is a write: ``TraceError``."""
    saved = [module._buffers[name] for module, name in held]
    for (module, name), t in zip(held, tensors):
        module._buffers[name] = t
    try:
        yield
        for (module, name), t in zip(held, tensors):
            if module._buffers[name] is not t:
                raise TraceError(f"it assigns its buffer {name} (a buffer is an input of its "
                                 f"programs, never written)")
    finally:
        for (module, name), b in zip(held, saved):
            module._buffers[name] = b
