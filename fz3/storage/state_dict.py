"""Full state dicts, gathered unit by unit: ``full_state_dict`` (a tree's own entries: params,
gradients, a moment) and ``module_state_dict`` (everything ``load_state_dict(strict=True)``
needs: the trained params, the frozen ones and the persistent buffers)."""

from __future__ import annotations

from typing import Any

import torch

from ..comm.arrival import DEFAULT_TIMEOUT_S, arrive
from ..comm.groups import refuse_destroyed
from ..sharding.model import Params, ShardedModel
from ..sharding.params import check_tree
from .gather import Gathered, own_buffers, unit_shards


def full_state_dict(model: ShardedModel, tree: Params, *, timeout: float = DEFAULT_TIMEOUT_S,
                    buffers: Any = None) -> dict[str, torch.Tensor] | None:
    """Gather ``tree`` (params, grads, an optimizer moment: anything shaped like params) into
    ``{original name: full tensor}`` of the *trained* parameters on (global) rank 0, in
    ``module.state_dict()`` order, cast to each parameter's original dtype; ``None`` on other
    ranks. Nothing the tree does not hold is added: gradients are never mixed with weights.
    For a state dict the original module loads with ``load_state_dict(strict=True)`` (frozen
    parameters and buffers too), use ``fz3.module_state_dict(model, params)``.

    **Collective**: every rank must call it. One unit is gathered at a time, so the extra
    memory on ranks other than 0 is one unit. A rank that does not call it within ``timeout``
    seconds is named by the others (``fz3.CollectiveMismatchError``)."""
    if buffers is not None:
        raise TypeError(f"fz3.full_state_dict(..., buffers={buffers!r}) is gone: it returns the "
                        f"tree's own (trained) entries only. For frozen weights and buffers as "
                        f"well (load_state_dict(strict=True)), call "
                        f"fz3.module_state_dict(model, params)")
    return _gather(model, tree, "fz3.full_state_dict", timeout, with_model=False)


def module_state_dict(model: ShardedModel, params: Params, *,
                      timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, torch.Tensor] | None:
    """The original module's whole state dict on (global) rank 0 (``None`` elsewhere): the
    trained ``params``, the frozen parameters and the persistent buffers the model holds
    itself, in ``module.state_dict()`` order, so ``module.load_state_dict(sd, strict=True)``
    works. Pass the params, not gradients or moments (``full_state_dict`` is for those).
    **Collective**, as ``full_state_dict``."""
    return _gather(model, params, "fz3.module_state_dict", timeout, with_model=True)


def _gather(model: ShardedModel, tree: Params, what: str, timeout: float,
            with_model: bool) -> dict[str, torch.Tensor] | None:
    refuse_destroyed(model.comm, what)
    check_tree(model, tree, "the tree")
    arrive(model.comm.group, what, timeout, model.comm.heartbeat)
    found: dict[str, torch.Tensor] = {}
    for unit, pieces in Gathered(model, unit_shards(model, tree, frozen=with_model)):
        for slot, t in pieces or []:
            found.update({unit.prefix + n: t for n in slot.names})
    if not model.is_root:
        return None
    own = own_buffers(model) if with_model else {}
    # module.state_dict() order: parameters from the units, buffers the model's own
    return {name: found[name] if name in found else own[name]
            for name in model.skeleton.state_dict() if name in found or name in own}
