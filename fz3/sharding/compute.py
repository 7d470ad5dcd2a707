"""The math of one unit over its gathered flat buffer, through ``torch.func.functional_call``.

Nothing here communicates. Gathered buffers arrive as ``(full,)`` for the outer unit and
``(k, full)`` for a unit of k layers; parameters are views into them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.func import functional_call

from .layout import FlatLayout
from .model import ShardedModel

Extras = tuple[Any, ...]


def bind(layout: FlatLayout, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{"m.<name>": tensor}`` for ``functional_call`` on a ``_Bound`` (tied names share one tensor)."""
    return {"m." + n: t for s, t in zip(layout.slots, tensors) for n in s.names}


def leaves(views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Autograd leaves that alias ``views`` (no copy): their gradients come back one per parameter."""
    return [v.detach().requires_grad_() for v in views]


def pre(model: ShardedModel, params: Sequence[torch.Tensor], batch: Any) -> tuple[torch.Tensor, Extras]:
    out = functional_call(model.pre, bind(model.outer, params), (batch,), tie_weights=False)
    h, extras = (out[0], tuple(out[1:])) if isinstance(out, tuple) and out else (out, ())
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"pre returned {type(out).__name__}; return h or (h, *extra) with h a tensor")
    if h.is_meta:
        raise ValueError("pre's output is on the meta device: pre used a parameter outside the outer unit (one "
                         "of the layers'?). pre and post may use only parameters outside the layer stack")
    return h, extras


def post(model: ShardedModel, params: Sequence[torch.Tensor], h: torch.Tensor, batch: Any) -> torch.Tensor:
    loss = functional_call(model.post, bind(model.outer, params), (h, batch), tie_weights=False)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"post must return a scalar loss tensor, got {type(loss).__name__}"
                        f"{'' if not isinstance(loss, torch.Tensor) else f' of shape {list(loss.shape)}'}")
    if loss.is_meta:
        raise ValueError("post's loss is on the meta device: post used a parameter outside the outer unit (one "
                         "of the layers'?). pre and post may use only parameters outside the layer stack")
    return loss.reshape(())


def layers(model: ShardedModel, first: int, params: Sequence[Sequence[torch.Tensor]], h: torch.Tensor,
           extras: Extras) -> torch.Tensor:
    """Run layers ``first, first+1, ...`` (one parameter list each) on ``h``."""
    for j, p in enumerate(params):
        h = functional_call(model.blocks[first + j], bind(model.layer, p), (h, *extras), tie_weights=False)
        if not isinstance(h, torch.Tensor):
            raise TypeError(f"layer {first + j} returned {type(h).__name__}, not a tensor; pass "
                            f"layer=lambda block, h, *extra: block(h, *extra)[0] to fz3.shard")
    return h


def layer_views(layout: FlatLayout, flat: torch.Tensor) -> list[list[torch.Tensor]]:
    """Views of each layer's parameters in a ``(k, full)`` gathered buffer."""
    return [layout.views(row) for row in flat]


def flat_grads(layout: FlatLayout, grads: Sequence[Sequence[torch.Tensor | None]], like: torch.Tensor) -> torch.Tensor:
    """``(k, padded)``: k layers' flat gradients from their per-parameter gradients (None =
    zero), padding zero, in one ``torch.cat``. Autograd through the views of the gathered
    buffer would instead scatter each view's gradient into a full-size zero buffer and add
    them up (quadratic in the parameter count)."""
    parts = [p for g in grads for p in _parts(layout, g, like)]
    if not parts:
        return torch.zeros(len(grads), layout.padded, dtype=like.dtype, device=like.device)
    return torch.cat(parts).view(len(grads), layout.padded)


def _parts(layout: FlatLayout, grads: Sequence[torch.Tensor | None], like: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.zeros(s.numel, dtype=like.dtype, device=like.device) if g is None else g.reshape(-1)
             for s, g in zip(layout.slots, grads)]
    if layout.pad:
        parts.append(torch.zeros(layout.pad, dtype=like.dtype, device=like.device))
    return parts


def differentiable(extras: Extras) -> list[int]:
    """Positions of extras that carry gradient (floating tensors that require grad)."""
    return [i for i, e in enumerate(extras) if isinstance(e, torch.Tensor) and e.requires_grad]
