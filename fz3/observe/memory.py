"""``fz3.memory_plan``: per-rank bytes of a schedule, by category, before step 1.

Persistent: the fp32 shards of params, grads and optimizer state (``optimizer_states``
copies: 2 for AdamW). Transient, op by op: gathered parameter buffers, unreduced flat
gradients, layer inputs kept for recompute (these three are the executor's own buffers; it
reports the same numbers through ``fz3.Recorder``) and autograd graphs kept by
``forward_save`` units and by ``pre`` (measured once by running ``pre`` and one layer on the
given batch with zero parameters, counting the storages autograd saves).

Not counted: the allocator's slack and rounding, kernels' workspaces, and whatever the
user's code holds.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..sharding import compute as units
from ..sharding.model import ShardedModel
from ..schedule.schedule import OUTER, Schedule

MiB = 2**20


class MemoryPlan(NamedTuple):
    params: int  # sharded fp32 parameters
    grads: int  # sharded fp32 gradients (allocated unit by unit as reduces are issued)
    optimizer: int  # sharded optimizer state
    gathered: int  # peak gathered parameter buffers
    unsharded_grads: int  # peak unreduced flat gradients
    saved_inputs: int  # peak layer inputs kept for recompute
    graphs: int  # peak autograd graphs kept (forward_save units, pre) and recomputed (during backward)
    peak: int  # persistent + the largest transient total at any op
    per_op: tuple[tuple[int, int, int, int], ...]  # (gathered, unsharded grads, saved inputs, graphs) after each op

    def __str__(self) -> str:
        rows = [("sharded params", self.params), ("sharded grads", self.grads), ("optimizer state", self.optimizer),
                ("gathered units (peak)", self.gathered), ("unreduced gradients (peak)", self.unsharded_grads),
                ("saved layer inputs (peak)", self.saved_inputs), ("autograd graphs (peak)", self.graphs),
                ("peak per rank", self.peak)]
        return "\n".join(f"{name:<28} {b / MiB:10.2f} MiB" for name, b in rows)


def memory_plan(model: ShardedModel, schedule: Schedule, batch: Any, *, optimizer_states: int = 2) -> MemoryPlan:
    """Predict this rank's memory for ``schedule`` on batches shaped like ``batch``.

    Within an op it also counts what lives only during it: a recomputed unit's graph and its
    per-parameter gradients before they are joined into one flat gradient (backward), the
    head's graph (loss), and the join of the gradient shards into the layer stack (end).
    """
    csize = torch.empty((), dtype=model.precision.compute).element_size()
    rsize = torch.empty((), dtype=model.precision.reduce).element_size()
    shard_bytes = (model.outer.shard_numel + model.num_layers * model.layer.shard_numel) * 4
    h_bytes, pre_graph, layer_graph, post_graph = _activation_sizes(model, batch)

    def numel(u: int) -> int:
        return model.outer.padded if u == OUTER else len(schedule.layer_range(u)) * model.layer.padded

    def shard_numel(u: int) -> int:
        return model.outer.shard_numel if u == OUTER else len(schedule.layer_range(u)) * model.layer.shard_numel

    gathered = grads = inputs = graphs = shards = 0
    in_flight: dict[int, int] = {}  # unit -> unreduced gradient bytes
    kept: dict[int, tuple[int, int]] = {}  # unit -> (saved input bytes, graph bytes)
    per_op, peak_transient = [], 0
    for kind, u in schedule.ops:
        during = 0
        if kind == "gather":
            gathered += numel(u) * csize
        elif kind == "free":
            gathered -= numel(u) * csize
        elif kind in ("forward", "forward_save") and schedule.grad:
            if u == OUTER:  # pre's graph is kept whenever gradients are wanted
                kept[u] = (0, pre_graph)
            elif kind == "forward_save":
                kept[u] = (0, layer_graph * len(schedule.layer_range(u)))
            else:
                kept[u] = (h_bytes, 0)
            inputs += kept[u][0]
            graphs += kept[u][1]
        elif kind == "loss":
            during = post_graph
        elif kind == "backward":
            saved_input, graph = kept.pop(u)
            recomputed = 0 if u == OUTER or graph else layer_graph * len(schedule.layer_range(u))
            during = recomputed + numel(u) * csize  # per-parameter gradients before the join
            inputs -= saved_input
            graphs -= graph
            in_flight[u] = numel(u) * rsize
            grads += in_flight[u]
        elif kind == "reduce":
            shards += shard_numel(u) * 4
        elif kind in ("wait_reduce", "accumulate"):
            grads -= in_flight.pop(u)
        per_op.append((gathered, grads, inputs, graphs))
        peak_transient = max(peak_transient, gathered + grads + inputs + graphs + shards + during)
    if schedule.grad and schedule.num_units > 1:  # the layer shards are joined into one (L, n) stack
        peak_transient = max(peak_transient, shards + model.num_layers * model.layer.shard_numel * 4)
    cols = list(zip(*per_op)) if per_op else [[0]] * 4
    during_graphs = max((layer_graph * len(schedule.layer_range(u)) for k, u in schedule.ops
                         if k == "backward" and u != OUTER), default=0)
    persistent = shard_bytes * (1 + optimizer_states) if schedule.grad else shard_bytes
    return MemoryPlan(
        params=shard_bytes,
        grads=shard_bytes if schedule.grad else 0,
        optimizer=optimizer_states * shard_bytes if schedule.grad else 0,
        gathered=max(cols[0]),
        unsharded_grads=max(cols[1]),
        saved_inputs=max(cols[2]),
        graphs=max(max(cols[3]), during_graphs, post_graph),
        peak=persistent + peak_transient,
        per_op=tuple(per_op),
    )


def _activation_sizes(model: ShardedModel, batch: Any) -> tuple[int, int, int, int]:
    """(bytes of a layer input, bytes pre's graph keeps, bytes one layer's graph keeps, bytes
    post's graph keeps).

    Runs ``pre``, layer 0 and ``post`` on zero parameters (values do not matter, shapes do),
    with ``saved_tensors_hooks`` counting each storage autograd saves once, parameters
    excluded. A measurement at plan time only: the executor itself uses no hooks.
    """
    dev, dtype = model.device, model.precision.compute
    outer = torch.zeros(model.outer.padded, dtype=dtype, device=dev)
    layer = torch.zeros(model.layer.padded, dtype=dtype, device=dev)
    params = {outer.untyped_storage().data_ptr(), layer.untyped_storage().data_ptr()}

    def graph_bytes(fn) -> tuple[int, Any]:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                seen[s.data_ptr()] = s.nbytes()
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        return sum(seen.values()), out

    outer_leaves = units.leaves(model.outer.views(outer))
    pre_graph, (h, extras) = graph_bytes(lambda: units.pre(model, outer_leaves, batch))
    h_bytes = h.numel() * h.element_size()
    x = h.detach().requires_grad_()
    post_graph, _ = graph_bytes(lambda: units.post(model, outer_leaves, x, batch))
    if model.num_layers == 0:
        return h_bytes, pre_graph, 0, post_graph
    ex = tuple(e.detach() if isinstance(e, torch.Tensor) else e for e in extras)
    layer_graph, _ = graph_bytes(lambda: units.layers(model, 0, [units.leaves(model.layer.views(layer))], x, ex))
    return h_bytes, pre_graph, layer_graph, post_graph
