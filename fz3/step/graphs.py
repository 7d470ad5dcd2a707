"""Graph-captured layers on CUDA (``cuda_graphs=True``): each layer's compute replayed as a
CUDA graph, so a layer costs one replay of host time instead of a launch per kernel.

[Note: fixed addresses]
A CUDA graph replays kernels on the addresses it was captured with. The executor gathers a
stack's units into a ring of preallocated buffers, one slot per unit that can be gathered at
once (prefetch depth + 1 for the recompute policy, as FSDP2 reuses its all-gather buffers),
and each slot has its own captured graph (``torch.cuda.make_graphed_callables``) whose static
parameter input *is* the slot: nothing is copied in. The activation a layer reads is copied
into the graph's static input, and what it writes (the output, and in backward the gradients)
is copied out before the slot's next replay overwrites it.

Capture needs shapes that do not change: the first call fixes them, and a later batch of
another shape is refused (``check_shapes``) before any collective. Only the recompute policy
with one layer per unit is captured: a kept graph (``save``) would hold views of a slot the
ring reuses. Layers must draw no random numbers in training (dropout): a replay draws its own.
Not yet run on a GPU in this project: ``benchmarks/gpu_check.py --part graphs`` checks it
against eager when a session has one.
"""

from __future__ import annotations

from typing import Any, Sequence

import optree
import torch

from ..schedule.ops import OpKind
from ..schedule.schedule import Schedule
from ..schedule.structure import Role
from ..sharding.binding import Binding
from ..sharding.parts import Part


class GraphedLayers:
    """Per stack part: a ring of gather slots and one captured layer function per slot."""

    def __init__(self, parts: Sequence[Part], schedule: Schedule, device: torch.device,
                 dtype: torch.dtype, world: int):
        for u in schedule.units:
            if u.role is Role.STACK and len(u.rows) != 1:
                raise ValueError("cuda_graphs=True captures one layer per unit: "
                                 "use layers_per_unit=1")
        if any(op.kind is OpKind.FORWARD_SAVE for op in schedule.ops):
            raise ValueError("cuda_graphs=True needs activations='recompute': a kept graph (save) "
                             "holds views of a gather slot that the ring reuses")
        self.parts, self.device, self.dtype, self.world = parts, device, dtype, world
        self.slots = {p: _slots_needed(schedule, p)
                      for p in {u.part for u in schedule.units if u.role is Role.STACK}}
        self.ring: dict[int, list[torch.Tensor]] = {}
        self.held: dict[int, dict[int, int]] = {}  # part -> {slot: unit}
        self.graphed: dict[tuple[int, int], Any] = {}
        self.shapes: tuple | None = None

    def slot(self, part: int, unit: int) -> torch.Tensor:
        """A free slot of ``part``'s ring for ``unit`` to be gathered into: ``(world * shard,)``."""
        if part not in self.ring:
            n = self.world * self.parts[part].layout.shard_numel
            self.ring[part] = [torch.empty(n, dtype=self.dtype, device=self.device)
                               for _ in range(self.slots[part])]
            self.held[part] = {}
        held = self.held[part]
        free = next(i for i in range(len(self.ring[part])) if i not in held)
        held[free] = unit
        return self.ring[part][free]

    def release(self, part: int, unit: int) -> None:
        held = self.held.get(part, {})
        for slot, u in list(held.items()):
            if u == unit:
                del held[slot]

    def __call__(self, part: int, unit: int, binding: Binding, row: torch.Tensor, h: torch.Tensor,
                 extras: tuple) -> torch.Tensor:
        """One layer, replayed: ``row`` is the slot ``unit`` holds (or a leaf aliasing it)."""
        slot = next(i for i, u in self.held[part].items() if u == unit)
        key = (part, slot)
        if key not in self.graphed:
            self.graphed[key] = self._capture(part, slot, binding, h, extras)
        out = self.graphed[key](row, h, *extras)
        return out.clone()  # the next replay of this slot's graph overwrites its static output

    def _capture(self, part: int, slot: int, binding: Binding, h: torch.Tensor, extras: tuple):
        layout = self.parts[part].layout
        if any(not isinstance(e, torch.Tensor) for e in extras):
            raise ValueError("cuda_graphs=True passes the extras to a captured graph: they must "
                             "all be tensors")

        def layer(row: torch.Tensor, x: torch.Tensor, *ex: torch.Tensor) -> torch.Tensor:
            return binding.traced(layout.views(row), (x, *ex))

        row = self.ring[part][slot].detach().requires_grad_()
        sample = (row, h.detach().clone().requires_grad_(),
                  *(e.detach().clone().requires_grad_(e.requires_grad) for e in extras))
        return torch.cuda.make_graphed_callables(layer, sample)

    def check_shapes(self, batch: Any) -> None:
        """The first call's batch shapes are the captured ones; another shape is refused."""
        shapes = tuple((tuple(t.shape), t.dtype) for t in optree.tree_leaves(batch)
                       if isinstance(t, torch.Tensor))
        if self.shapes is None:
            self.shapes = shapes
        elif shapes != self.shapes:
            raise ValueError(f"cuda_graphs=True replays graphs captured for batches shaped "
                             f"{self.shapes}; this batch is {shapes}. Pad batches to one shape, or "
                             f"build another step function for this shape (or drop cuda_graphs)")


def _slots_needed(schedule: Schedule, part: int) -> int:
    """The most units of ``part`` gathered (or in flight) at once in ``schedule``."""
    live, most = set(), 0
    for op in schedule.ops:
        if schedule.units[op.unit].part != part:
            continue
        if op.kind is OpKind.GATHER:
            live.add(op.unit)
        elif op.kind is OpKind.FREE:
            live.discard(op.unit)
        most = max(most, len(live))
    return max(most, 1)
