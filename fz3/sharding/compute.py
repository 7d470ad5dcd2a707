"""The math of one unit over its gathered flat buffers, through ``torch.func.functional_call``.

Nothing here communicates. A gathered part arrives as ``(full,)`` (``(k, full)`` for k
layers of a stack); parameters are views into it, bound by name (``bind``) for the
function that runs the part.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch.func import functional_call

from .layout import FlatLayout
from .model import BoundFunction, ShardedModel

Extras = tuple[Any, ...]


def bind(layout: FlatLayout, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{"m.<name>": tensor}`` for ``functional_call`` on a ``BoundFunction`` (tied names
    share one tensor)."""
    return {"m." + n: t for s, t in zip(layout.slots, tensors) for n in s.names}


def leaves(views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Autograd leaves that alias ``views`` (no copy): their gradients come back one per parameter."""
    return [v.detach().requires_grad_() for v in views]


@contextlib.contextmanager
def mode(model: ShardedModel) -> Iterator[None]:
    """The skeleton in ``model.training`` mode for one step, as it was afterwards: two step
    functions on models in different modes share the skeleton without changing each other."""
    before = model.skeleton.training
    if before != model.training:
        model.skeleton.train(model.training)
    try:
        yield
    finally:
        if before != model.training:
            model.skeleton.train(before)


def _call(fn: BoundFunction, bound: dict[str, torch.Tensor], args: tuple, name: str) -> Any:
    """``functional_call``, naming a parameter of another part used by mistake: it is still on
    the meta device in the skeleton, and an op that mixes it with real tensors fails."""
    try:
        return functional_call(fn, bound, args, tie_weights=False)
    except (RuntimeError, NotImplementedError) as e:
        if "meta" not in str(e):
            raise
        raise ValueError(f"{name} used a parameter outside its part: it is on the meta device ({e}). A "
                         f"function may use only the parameters registered in its part (see fz3.shard's "
                         f"assign= to move some)") from e


def run_stage(fn: BoundFunction, bound: dict[str, torch.Tensor], args: tuple, name: str) -> tuple[torch.Tensor, Extras]:
    """``pre`` or a ``between`` function: ``fn(m, *args) -> h | (h, *extras)``."""
    out = _call(fn, bound, args, name)
    h, extras = (out[0], tuple(out[1:])) if isinstance(out, tuple) and out else (out, ())
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"{name} returned {type(out).__name__}; return h or (h, *extra) with h a tensor")
    if h.is_meta:
        raise ValueError(f"{name} used a parameter outside its part: its output is on the meta device. A "
                         f"function may use only the parameters registered in its part (see fz3.shard's "
                         f"assign= to move some)")
    return h, extras


def run_loss(fn: BoundFunction, has_aux: bool, bound: dict[str, torch.Tensor], h: torch.Tensor, batch: Any,
             name: str) -> tuple[torch.Tensor, Any]:
    """``(loss, aux)``: ``fn(m, h, batch)`` returns the scalar loss, or ``(loss, aux)`` when
    ``has_aux``; ``aux`` is None without it."""
    out = _call(fn, bound, (h, batch), name)
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"{name} was given with has_aux=True and must return (loss, aux), got "
                            f"{type(out).__name__}")
        out, aux = out
    else:
        aux = None
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        shape = f" of shape {list(out.shape)}" if isinstance(out, torch.Tensor) else ""
        hint = "" if has_aux else " (returning (loss, aux)? pass has_aux=True)"
        raise TypeError(f"{name} must return a scalar loss tensor, got {type(out).__name__}{shape}{hint}")
    if out.is_meta:
        raise ValueError(f"{name} used a parameter outside its part: its loss is on the meta device. A "
                         f"function may use only the parameters registered in its part (see fz3.shard's "
                         f"assign= to move some)")
    return out.reshape(()), aux


def run_layers(fns: Sequence[BoundFunction], layout: FlatLayout, params: Sequence[Sequence[torch.Tensor]],
               h: torch.Tensor, extras: Extras, names: Sequence[str],
               frozen: tuple[FlatLayout, Sequence[Sequence[torch.Tensor]]] | None = None) -> torch.Tensor:
    """Run consecutive layers (one function, one parameter list, one name each) on ``h``;
    ``frozen``: the frozen parameters' layout and their views, one list per layer."""
    for j, (fn, p, name) in enumerate(zip(fns, params, names)):
        bound = bind(layout, p)
        if frozen is not None:
            bound.update(bind(frozen[0], frozen[1][j]))
        h = _call(fn, bound, (h, *extras), f"layer {name}")
        if not isinstance(h, torch.Tensor):
            raise TypeError(f"layer {name} returned {type(h).__name__}, not a tensor; pass "
                            f"call_layer=lambda layer, h, *extra: layer(h, *extra)[0] to fz3.shard")
    return h


def layer_views(layout: FlatLayout, flat: torch.Tensor) -> list[list[torch.Tensor]]:
    """Views of each layer's parameters in a ``(k, full)`` gathered buffer."""
    return [layout.views(row) for row in flat]


def flat_grads(layout: FlatLayout, grads: Sequence[Sequence[torch.Tensor | None]],
               like: torch.Tensor) -> torch.Tensor:
    """``(k, padded)``: k rows' flat gradients from their per-parameter gradients (None =
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


def layer_leaves(views: Sequence[Sequence[torch.Tensor]], x: torch.Tensor, extras: Extras,
                 grad_positions: Sequence[int]) -> tuple[list[list[torch.Tensor]], torch.Tensor, Extras]:
    """Autograd leaves for a layer unit: parameters (per layer), input, differentiable extras."""
    params = [leaves(v) for v in views]
    x_leaf = x.detach().requires_grad_()
    extras = tuple(e.detach().requires_grad_() if j in grad_positions else e for j, e in enumerate(extras))
    return params, x_leaf, extras


def layer_flat_grad(layout: FlatLayout, world: int, grads: Sequence[torch.Tensor | None], k: int,
                    like: torch.Tensor, *, by_layer: bool) -> torch.Tensor:
    """``(world, k, n)``: a unit of k layers' flat gradient from its per-parameter gradients
    (layer by layer), each layer's ``(world, n)`` in rank order. ``by_layer``: the memory may
    be layer-major (an all-reduce sums in any order); otherwise it is rank-major, since a
    reduce-scatter hands rank r the r-th contiguous chunk."""
    per = len(layout.slots)
    layers = [grads[j * per:(j + 1) * per] for j in range(k)]
    if k == 1 or by_layer:
        # One cat, layer-major (k, world, n), seen as (world, k, n); for one layer the two
        # orders are the same memory.
        return flat_grads(layout, layers, like).view(k, world, -1).transpose(0, 1)
    return torch.stack([flat_grads(layout, [g], like).view(world, -1) for g in layers], 1)


def differentiable(extras: Extras) -> list[int]:
    """Positions of extras that carry gradient (floating tensors that require grad)."""
    return [i for i, e in enumerate(extras) if isinstance(e, torch.Tensor) and e.requires_grad]
