"""The math of one unit over its gathered flat buffers.

Nothing here communicates. A gathered part arrives as ``(full,)`` (``(k, full)`` for k
layers of a stack); parameters are views into it (``FlatLayout.views``), handed to the
part's function through its ``Binding``. For gradients the gathered buffer itself is the
autograd leaf: the views are ``split`` and ``view`` of it, whose backward is one ``cat``, so
the unit's flat gradient comes out of autograd whole (no per-parameter leaves, no join).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, NamedTuple, Sequence

import optree
import torch

from .binding import Binding
from .model import ShardedModel
from .unreachable import PartReadError

Extras = tuple[Any, ...]


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


def leaf(buffer: torch.Tensor) -> torch.Tensor:
    """An autograd leaf aliasing a gathered buffer (no copy): its gradient is the flat gradient."""
    return buffer.detach().requires_grad_()


def call(binding: Binding, tensors: Sequence[torch.Tensor], args: tuple, name: object) -> Any:
    """``binding(tensors, args)``; a parameter of another part read by mistake (the skeleton
    holds an ``Unreachable`` for it) raises ``PartReadError`` naming it, its part, this
    function and the fix."""
    try:
        return binding(tensors, args)
    except PartReadError as e:
        reader = (None if isinstance(name, LayerName)
                  else "post" if name == "the loss function" else str(name))
        raise e.named(str(name), reader) from None


def _meta_output(name: object, what: str) -> ValueError:
    return ValueError(f"{name} returned {what} on the meta device; a function of the model must "
                      f"compute on the device of its parameters and batch")


def run_stage(binding: Binding, tensors: Sequence[torch.Tensor], args: tuple,
              name: str) -> tuple[torch.Tensor, Extras]:
    """``pre`` or a ``between`` function: ``fn(m, *args) -> h | (h, *extras)``."""
    out = call(binding, tensors, args, name)
    h, extras = (out[0], tuple(out[1:])) if isinstance(out, tuple) and out else (out, ())
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"{name} returned {type(out).__name__}; return h or (h, *extra) with h a "
                        f"tensor")
    if h.is_meta:
        raise _meta_output(name, "h")
    for i, e in enumerate(extras):  # blamed here, not on the first layer that reads it
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in optree.tree_leaves(e)):
            raise _meta_output(name, f"its extra output {i}")
    return h, extras


def run_loss(binding: Binding, has_aux: bool, tensors: Sequence[torch.Tensor], h: torch.Tensor,
             batch: Any, name: str, layer_aux: tuple | None = None) -> tuple[torch.Tensor, Any]:
    """``(loss, aux)``: ``fn(m, h, batch)`` (``fn(m, h, batch, layer_aux)`` when the layers
    return aux outputs: one tensor per stack) returns the scalar loss, or ``(loss, aux)`` when
    ``has_aux``; ``aux`` is None without it."""
    args = (h, batch) if layer_aux is None else (h, batch, layer_aux)
    out = call(binding, tensors, args, name)
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
        raise TypeError(f"{name} must return a scalar loss tensor, got "
                        f"{type(out).__name__}{shape}{hint}")
    if out.is_meta:
        raise _meta_output(name, "its loss")
    return out.reshape(()), aux


class LayerName(NamedTuple):
    """``layer <path>.<index>``: what an error calls a layer, formatted only when one is
    raised (the per-layer path builds no strings)."""

    path: str
    index: int

    def __str__(self) -> str:
        return f"layer {self.path}.{self.index}"


def run_layers(bindings: Sequence[Binding], rows: Sequence[Sequence[torch.Tensor]],
               h: torch.Tensor, extras: Extras, path: str, first: int,
               writes: dict, aux: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(h, aux)``: consecutive layers (one binding and one tensor list each) run on ``h``;
    they are layers ``first, first + 1, ...`` of the stack at ``path`` (for error messages).
    The first is ``guarded`` by ``writes``: the later ones' inputs are the earlier ones'
    outputs. ``aux``: each layer returns ``(h, aux)`` (``ShardedModel.layer_aux``), their aux
    stacked ``(layers, *shape)``; otherwise None."""
    auxes = []
    for j, (binding, tensors) in enumerate(zip(bindings, rows)):
        name = LayerName(path, first + j)
        out = (guarded(writes, binding, tensors, h, extras, name) if j == 0
               else call(binding, tensors, (h, *extras), name))
        if not aux and isinstance(out, torch.Tensor):  # the per-layer path: no call more
            h = out
        else:
            h = layer_output(out, aux, name)
            auxes.append(out[1])
    return h, (aux_stack(auxes, path, first) if aux else None)


def layer_output(out: Any, aux: bool, name: object) -> torch.Tensor:
    """A layer's h from what it returned under ``aux`` (``(h, aux)``); otherwise (it returned
    no tensor) a TypeError naming the layer and the fix."""
    if aux:
        if (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor)
                and isinstance(out[1], torch.Tensor) and out[1].is_floating_point()):
            return out[0]
        got = (f"a tuple of {[type(o).__name__ for o in out]}" if isinstance(out, tuple)
               else type(out).__name__)
        raise TypeError(f"{name} returned {got}; with layer_aux=True every layer returns "
                        f"(h, aux), both tensors, aux a floating one (it has a gradient)")
    if not isinstance(out, torch.Tensor):
        hint = (" (a layer returning (h, aux) on purpose: pass layer_aux=True to fz3.shard)"
                if isinstance(out, tuple) and len(out) == 2 else "")
        raise TypeError(f"{name} returned {type(out).__name__}, not a tensor; pass "
                        f"call_layer=lambda layer, h, *extra: layer(h, *extra)[0] to fz3.shard"
                        f"{hint}")
    return out


def aux_stack(auxes: Sequence[torch.Tensor], path: str, first: int) -> torch.Tensor:
    """Consecutive layers' aux outputs as one ``(layers, *shape)`` tensor; a ValueError naming
    the first layer whose aux differs in shape or dtype from the first's."""
    for j, a in enumerate(auxes[1:], 1):
        if a.shape != auxes[0].shape or a.dtype != auxes[0].dtype:
            raise ValueError(f"{LayerName(path, first + j)} returned an aux of shape "
                             f"{list(a.shape)} {a.dtype}, layer {path}.{first}'s is "
                             f"{list(auxes[0].shape)} {auxes[0].dtype}: the layers of a stack "
                             f"return aux outputs of one shape and dtype")
    return stacked(auxes)


def stacked(auxes: Sequence[torch.Tensor]) -> torch.Tensor:
    """Consecutive layers' aux outputs, of one shape, as one ``(layers, *shape)`` tensor
    (one layer's: a view)."""
    return auxes[0].unsqueeze(0) if len(auxes) == 1 else torch.stack(list(auxes))


def guarded(writes: dict, binding: Binding, tensors: Sequence[torch.Tensor], h: torch.Tensor,
            extras: Extras, name: object) -> torch.Tensor:
    """``call``: the first layer of a unit on its input ``h``, which the executor keeps (to
    recompute from) or differentiates (an autograd leaf, which no op may write into). A layer
    that writes into its input (``h.mul_(0.5)``, fine in plain PyTorch, where ``h`` is the
    previous layer's output) gets a copy, as does one not seen before (its first call: one
    copy, whose version counter says whether it was written); ``writes`` records which
    (``ShardedModel.writes_input``). Every other call: one dict lookup and a version check."""
    known = writes.get(binding)
    given = h if known is False else h.clone()
    version = given._version
    try:
        out = call(binding, tensors, (given, *extras), name)
    except RuntimeError as e:
        if known is False and "in-place" in str(e) and "leaf Variable" in str(e):
            raise RuntimeError(_written(name)) from e
        raise
    if given._version != version:
        if known is False:
            raise RuntimeError(_written(name))
        writes[binding] = True
    elif known is None:
        writes[binding] = False
    return out


def _written(name: object) -> str:
    return (f"{name} wrote into its input h in place on this call, but not on its first: fz3 "
            f"copies the input only of layers seen writing into it, and this one's input (kept "
            f"for recompute or differentiated) is no longer what it was. Write into a copy "
            f"(h = h.mul(0.5), or h = h.clone() first), or do it on every call")


def differentiable(extras: Extras) -> list[int]:
    """Positions of extras that carry gradient (floating tensors that require grad)."""
    return [i for i, e in enumerate(extras) if isinstance(e, torch.Tensor) and e.requires_grad]


def detach_extras(extras: Extras, positions: Sequence[int], *, grad: bool) -> Extras:
    """Extras as a layer sees them: those that carry gradient as fresh leaves (``grad``) or
    detached."""
    return tuple((e.detach().requires_grad_() if grad else e.detach()) if j in positions else e
                 for j, e in enumerate(extras))
