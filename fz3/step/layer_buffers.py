"""A layer's buffers as inputs of its traced programs (``fz3.step.traced``): where each is
held (``owners``), and the layer's function run with the trace's tensors in their place
(``substituted``), as ``fz3.sharding.binding`` puts gathered parameters into the skeleton.
``layer_function`` is a layer as its programs see it, buffers last. A buffer is read, never
written: a layer that assigns one anew is not traced (one written in place is refused with
every other input, ``fz3.step.joint``)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import optree
import torch
from torch import nn

from ..sharding.binding import Binding
from ..sharding.parts import Part
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


def layer_function(binding: Binding, part: Part, specs: list,
                   owners: Sequence[tuple[nn.Module, str]] = ()) -> Callable[..., torch.Tensor]:
    """The pure function of one layer: ``(row, frozen_row, h, *tensor extras, *buffers) ->
    h`` (or ``(h, aux)``), the extras' structure and non-tensor values constants of it;
    ``owners``: where each buffer is held (``layer_buffers.owners``)."""
    layout, frozen_layout = part.layout, part.frozen
    n = len(owners)

    def layer(row: torch.Tensor, frozen_row: torch.Tensor | None, h: torch.Tensor,
              *tensors: torch.Tensor) -> torch.Tensor:
        it = iter(tensors[:len(tensors) - n])
        extras = [optree.tree_unflatten(spec, [next(it) if isinstance(leaf, torch.Tensor)
                                               else leaf for leaf in leaves])
                  for leaves, spec in specs]
        views = layout.views(row) + ([] if frozen_row is None else frozen_layout.views(frozen_row))
        with substituted(owners, tensors[len(tensors) - n:]):
            out = binding(views, (h, *extras))
        new = out[0] if isinstance(out, tuple) and out else out
        if isinstance(new, torch.Tensor) and (new.shape != h.shape or new.dtype != h.dtype):
            raise TraceError(f"it maps h of shape {list(h.shape)} {h.dtype} to "
                             f"{list(new.shape)} {new.dtype} (traced layers keep h's shape)")
        return out

    return layer
