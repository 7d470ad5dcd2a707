"""``full_state_dict``: the original module's names -> full tensors, gathered unit by unit."""

from __future__ import annotations

import torch

from ..comm.arrival import DEFAULT_TIMEOUT_S, arrive
from ..sharding.model import Params, ShardedModel, check_tree
from .gather import gather_unit


def full_state_dict(model: ShardedModel, tree: Params, *, buffers: bool = True,
                    timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, torch.Tensor] | None:
    """Gather ``tree`` (params, grads, an optimizer moment: anything shaped like params) into
    ``{original name: full tensor}`` on (global) rank 0, in ``module.state_dict()`` order, cast
    to each parameter's original dtype; ``None`` on other ranks. **Collective**: every rank
    must call it.

    One unit is gathered at a time, so the extra memory on ranks other than 0 is one unit.
    ``buffers=True`` adds what the model holds itself: the module's persistent buffers and its
    frozen parameters (``requires_grad=False``), so ``full_state_dict(model, params)`` loads
    into the original module with ``load_state_dict(strict=True)``. Pass ``buffers=False`` for
    gradients and optimizer moments: they cover the trained parameters only. A rank that does
    not call it within ``timeout`` seconds is named by the others
    (``fz3.CollectiveMismatchError``).
    """
    check_tree(model, tree, "the tree")
    arrive(model.comm.group, "fz3.full_state_dict", timeout)
    rank0 = model.is_root
    found: dict[str, torch.Tensor] = {}
    for i, (part, shards) in enumerate(zip(model.parts, tree.parts)):
        pieces = [(part.layout, shards)]
        if buffers and part.frozen is not None:  # the model's own state: its frozen parameters
            pieces.append((part.frozen, model.frozen[i]))
        for layout, tensor in pieces:
            for row, shard in enumerate(tensor.reshape(part.rows, -1)):
                for slot, t in gather_unit(model, layout, shard) or []:
                    found.update({part.prefix(row) + n: t for n in slot.names})
    if not rank0:
        return None
    out: dict[str, torch.Tensor] = {}
    params = dict(model.skeleton.named_parameters(remove_duplicate=False))
    for name, t in model.skeleton.state_dict(keep_vars=True).items():
        if name in found:
            out[name] = found[name]
        elif buffers and name not in params:
            out[name] = t.detach().cpu().clone()
    return out

