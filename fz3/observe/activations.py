"""What a unit's forward leaves behind: the sizes the memory plan and the cost model need,
measured once on a batch (values do not matter, shapes do)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from ..sharding import compute
from ..sharding.model import ShardedModel


class ActivationSizes(NamedTuple):
    """Bytes, for one rank's batch."""

    layer_input: int  # one layer's input h (kept by recompute)
    pre_graph: int  # what autograd keeps for pre's graph
    layer_graph: int  # ... for one layer's graph (kept by forward_save, rebuilt by recompute)
    post_graph: int  # ... for post + loss


def activation_sizes(model: ShardedModel, batch: Any) -> ActivationSizes:
    """Runs ``pre``, layer 0 and ``post`` on zero parameters, with ``saved_tensors_hooks``
    counting each storage autograd saves once, parameters excluded. A measurement at plan
    time only: the executor itself uses no hooks."""
    dev, dtype = model.device, model.precision.compute
    outer = torch.zeros(model.outer.padded, dtype=dtype, device=dev)
    layer = torch.zeros(model.layer.padded, dtype=dtype, device=dev)
    params = {outer.untyped_storage().data_ptr(), layer.untyped_storage().data_ptr()}
    outer_leaves = compute.leaves(model.outer.views(outer))
    pre_graph, (h, extras) = _graph_bytes(lambda: compute.run_pre(model, outer_leaves, batch), params)
    h_bytes = h.numel() * h.element_size()
    x = h.detach().requires_grad_()
    post_graph, _ = _graph_bytes(lambda: compute.run_loss(model, model.post, False, outer_leaves, x, batch), params)
    if model.num_layers == 0:
        return ActivationSizes(h_bytes, pre_graph, 0, post_graph)
    ex = tuple(e.detach() if isinstance(e, torch.Tensor) else e for e in extras)
    layer_leaves = [compute.leaves(model.layer.views(layer))]
    layer_graph, _ = _graph_bytes(lambda: compute.run_layers(model, 0, layer_leaves, x, ex), params)
    return ActivationSizes(h_bytes, pre_graph, layer_graph, post_graph)


def _graph_bytes(fn: Callable[[], Any], exclude: set[int]) -> tuple[int, Any]:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out
