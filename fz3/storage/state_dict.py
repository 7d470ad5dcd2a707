"""``full_state_dict``: the original module's names -> full tensors, gathered unit by unit."""

from __future__ import annotations

import torch

from ..comm.arrival import DEFAULT_TIMEOUT_S, arrive
from ..comm.collectives import all_gather, wait
from ..sharding.layout import FlatLayout
from ..sharding.model import Params, ShardedModel


def full_state_dict(model: ShardedModel, tree: Params, *, buffers: bool = True,
                    timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, torch.Tensor] | None:
    """Gather ``tree`` (params, grads, an optimizer moment: anything shaped like params) into
    ``{original name: full tensor}`` on (global) rank 0, in ``module.state_dict()`` order, cast
    to each parameter's original dtype; ``None`` on other ranks. Every rank must call it.

    One unit is gathered at a time, so the extra memory on ranks other than 0 is one unit.
    ``buffers=True`` adds the module's persistent buffers, so the result loads into the
    original module with ``load_state_dict(strict=True)``. Collective over the sharding group:
    a rank that does not call it within ``timeout`` seconds is named by the others
    (``fz3.CollectiveMismatchError``).
    """
    arrive(model.comm.group, "fz3.full_state_dict", timeout)
    rank0 = model.is_root
    found: dict[str, torch.Tensor] = {}
    _gather_unit(model, model.outer, tree.outer, "", found, rank0)
    for i in range(model.num_layers):
        _gather_unit(model, model.layer, tree.layers[i], f"{model.layers_path}.{i}.", found, rank0)
    if not rank0:
        return None
    out: dict[str, torch.Tensor] = {}
    params = dict(model.skeleton.named_parameters(remove_duplicate=False))
    for name, t in model.skeleton.state_dict(keep_vars=True).items():
        if name in params:
            out[name] = found[name]
        elif buffers:
            out[name] = t.detach().cpu().clone()
    return out


def _gather_unit(model: ShardedModel, layout: FlatLayout, shard: torch.Tensor, prefix: str,
                 found: dict[str, torch.Tensor], keep: bool) -> None:
    full = torch.empty(layout.padded, dtype=shard.dtype, device=shard.device)
    wait(all_gather(model.comm, full, shard.contiguous()))
    if not keep:
        return
    for s, v in zip(layout.slots, layout.views(full)):
        t = v.to(device="cpu", dtype=s.dtype, copy=True)
        for n in s.names:
            found[prefix + n] = t
