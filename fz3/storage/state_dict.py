"""``full_state_dict``: the original module's names -> full tensors, gathered unit by unit."""

from __future__ import annotations

import torch

from ..comm.arrival import DEFAULT_TIMEOUT_S, arrive
from ..sharding.model import Params, ShardedModel
from ..sharding.params import check_tree
from .gather import Gathered, own_buffers, unit_shards


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
    found: dict[str, torch.Tensor] = {}
    for unit, pieces in Gathered(model, unit_shards(model, tree, frozen=buffers)):
        for slot, t in pieces or []:
            found.update({unit.prefix + n: t for n in slot.names})
    if not model.is_root:
        return None
    own = own_buffers(model) if buffers else {}
    # module.state_dict() order: parameters from the units, buffers the model's own
    return {name: found[name] if name in found else own[name]
            for name in model.skeleton.state_dict() if name in found or name in own}
