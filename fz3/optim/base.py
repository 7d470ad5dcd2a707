"""Optimizers as ``GradientTransformation(init, update)``: two pure functions over pytrees
(optax)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree
import torch

from .checks import check_like, refuse_donated_tree

Tree = Any  # a pytree of tensors shaped like fz3.Params


class GradientTransformation(NamedTuple):
    init: Callable[[Tree], Any]  # params -> state
    update: Callable[..., tuple[Tree, Any]]  # (grads, state, params) -> (updates, state), pure
    # Optional fast path: (grads, state, params) -> (params, state) computed in place, reusing
    # (donating) the buffers of params and state, as a fused kernel does. See ``step``.
    update_inplace: Callable[..., tuple[Tree, Any]] | None = None
    # Optional per-unit form: (state, params) -> ``UnitStep``, the step taken a unit at a time
    # as its gradient lands (``fz3.train_step``), where the update is separable by layers
    # (``fz3.optim.per_unit``).
    per_unit: Callable[[Any, Tree], "UnitStep"] | None = None
    # Optional, for a transformation that multiplies the whole gradient by one factor computed
    # from its row norms (``clip_by_global_norm``): (state, row norms) -> (factor, state); the
    # norms are ``row_norms`` of every leaf, in tree order. ``chain(it, opt)`` then steps per
    # unit once the backward ends (``after_scaling``). Collective where the factor is.
    scaling: Callable[[Any, list[torch.Tensor]], tuple[torch.Tensor, Any]] | None = None
    # Whether the per-unit form steps nothing before every unit's gradient has landed (it
    # scales the whole gradient first): ``fz3.train_step`` puts its update ops after the
    # backward (``fz3.optim.per_unit.placement``)
    per_unit_last: bool = False
    # Optional, for a transformation that zeroes the updates outside a mask (``freeze``): the
    # mask, bool, shaped like params (True where updates apply). ``chain(opt, it)`` then runs
    # ``opt``'s in-place and per-unit forms and puts the masked elements back (``_kept_last``)
    keeps: Tree | None = None


class UnitStep(NamedTuple):
    """One optimizer step, taken a unit at a time, in place (params and state donated)."""

    # (leaf, layers, grad): step leaf ``leaf`` of params (a part, for ``fz3.Params``): the
    # layers ``layers`` of a stack part's (k, shard) leaf, or the whole leaf (None), with
    # their reduced gradient ``grad``, shaped like them (kept until ``finish`` where the
    # step needs every gradient first: ``after_scaling``; never written); each layer once
    update: Callable[[int, slice | None, torch.Tensor], None]
    finish: Callable[[], tuple[Tree, Any]]  # once every layer is stepped: (params, state)
    # a step that ends before ``finish``: params and state, stepped in part, are given up
    # (``fz3.optim.per_unit``'s; None from a transformation's own)
    abandon: Callable[[], None] | None = None


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` in order; the state is the tuple of their states."""

    def init(params: Tree) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(grads: Tree, state: tuple, params: Tree | None = None) -> tuple[Tree, tuple]:
        new = []
        for t, s in zip(transforms, state):
            grads, s = t.update(grads, s, params)
            new.append(s)
        return grads, tuple(new)

    last = transforms[-1] if transforms else None
    if len(transforms) == 1:  # its own fast paths (and placement), its state in a tuple
        return GradientTransformation(init, update, _one(last.update_inplace),
                                      _one(last.per_unit), per_unit_last=last.per_unit_last)
    per_unit = _scaled_first(*transforms) if len(transforms) == 2 else None
    last_ = per_unit is not None
    if len(transforms) == 2 and last.keeps is not None:  # (a clip first keeps its placement)
        inplace, per_unit = _kept_last(transforms[0], last.keeps)
        return GradientTransformation(init, update, inplace, per_unit,
                                      per_unit_last=transforms[0].per_unit_last)
    if last is None or last.update_inplace is None:
        return GradientTransformation(init, update, None, per_unit, per_unit_last=last_)

    def update_inplace(grads: Tree, state: tuple, params: Tree) -> tuple[Tree, tuple]:
        new = []
        for t, s in zip(transforms[:-1], state):
            grads, s = t.update(grads, s, params)
            new.append(s)
        params, s = last.update_inplace(grads, state[-1], params)
        return params, tuple(new) + (s,)

    return GradientTransformation(init, update, update_inplace, per_unit, per_unit_last=last_)


def _scaled_first(first: GradientTransformation, last: GradientTransformation
                  ) -> Callable[[tuple, Tree], UnitStep] | None:
    """``chain(first, last)``'s per-unit form where ``first`` is a whole-gradient scaling and
    ``last`` has one (``after_scaling``), else None."""
    if first.scaling is None or last.per_unit is None:
        return None
    return lambda state, params: after_scaling(first.scaling, state[0],
                                               last.per_unit(state[1], params))


def _kept_last(first: GradientTransformation, keeps: Tree) -> tuple:
    """``chain(first, freeze)``'s in-place and per-unit forms (each None where ``first`` has
    none): ``first``'s, the elements outside ``keeps`` copied before and put back after, so
    they keep their values exactly, as ``update``'s zeroed updates leave them (``first``'s
    moments move on for them in both)."""
    def held(params: Tree) -> list[torch.Tensor]:
        return [p.masked_select(~k) for p, k in zip(optree.tree_leaves(params),
                                                      optree.tree_leaves(keeps))]

    def put_back(params: Tree, saved: list[torch.Tensor]) -> Tree:
        for p, k, s in zip(optree.tree_leaves(params), optree.tree_leaves(keeps), saved):
            p.masked_scatter_(~k, s)
        return params

    def inplace(grads: Tree, state: tuple, params: Tree) -> tuple[Tree, tuple]:
        saved = held(params)
        params, s = first.update_inplace(grads, state[0], params)
        return put_back(params, saved), (s, state[1])

    def per_unit(state: tuple, params: Tree) -> UnitStep:
        saved, inner = held(params), first.per_unit(state[0], params)

        def finish() -> tuple[Tree, tuple]:
            params_, s = inner.finish()
            return put_back(params_, saved), (s, state[1])

        return UnitStep(inner.update, finish)

    return (inplace if first.update_inplace is not None else None,
            per_unit if first.per_unit is not None else None)


def row_norms(g: torch.Tensor) -> list[torch.Tensor]:
    """``g``'s L2 norms in fp32: one per row of a stack part's ``(k, shard)`` leaf, else one:
    the same bits whether the rows are a whole leaf's or one unit's (``after_scaling``)."""
    rows = g.unbind(0) if g.dim() == 2 else (g,)
    return [torch.linalg.vector_norm(r, dtype=torch.float32) for r in rows]


def after_scaling(scaling: Callable, state: Any, inner: UnitStep) -> UnitStep:
    """``inner`` (the next transformation's per-unit step) after a whole-gradient scaling
    (``GradientTransformation.scaling``): each unit's gradient is kept as it lands, with its
    row norms; ``finish`` computes the factor from all of them in tree order (the same bits
    as the transformation's ``update``), and steps each gradient times it (a unit's copy at
    a time: the caller's tensors are not written). The whole gradient is alive once (the
    update path's copy is not made). Collective: ``finish`` (the factor's, ``inner``'s)."""
    kept: dict[tuple[int, int], tuple] = {}  # (leaf, first row) -> (layers, grad, its norms)

    def update(leaf: int, layers: slice | None, grad: torch.Tensor) -> None:
        kept[leaf, 0 if layers is None else layers.start] = (layers, grad, row_norms(grad))

    def finish() -> tuple[Tree, tuple]:
        order = sorted(kept)
        factor, new = scaling(state, [n for key in order for n in kept[key][2]])
        for key in order:
            layers, grad, _ = kept.pop(key)
            inner.update(key[0], layers, grad * factor.to(grad.dtype))
        params, inner_state = inner.finish()
        return params, (new, inner_state)

    return UnitStep(update, finish)


def step(opt: GradientTransformation, grads: Tree, state: Any, params: Tree, *,
         donate: bool = False) -> tuple[Tree, Any]:
    """``(params, state)`` after one optimizer step.

    ``donate=False``: pure, ``apply_updates(params, opt.update(...))``; the inputs are untouched.
    ``donate=True``: ``params`` and ``state`` are given up (as with JAX's ``donate_argnums``;
    also when the step fails after its checks, a collective say, written in part):
    their buffers are updated in place by a fused kernel where ``opt`` has one, so the step
    reads and writes each element once and allocates nothing. Do not use the donated
    ``params``/``state`` afterwards; use the returned ones.
    """
    refuse_donated_tree(params, "params")
    refuse_donated_tree(state, "optimizer state")
    if donate and opt.update_inplace is not None:
        try:
            new_params, new_state = opt.update_inplace(grads, state, params)
        except (ValueError, TypeError):  # refused before anything was written: kept
            raise
        except BaseException:  # written in part, maybe (a collective failed midway): gone
            give_up(params, None)
            give_up(state, None)
            raise
        return give_up(params, new_params), give_up(state, new_state)
    updates, state = opt.update(grads, state, params)
    return apply_updates(params, updates), state


def _one(fast: Callable | None) -> Callable | None:
    """A one-transformation chain's ``update_inplace`` or ``per_unit``: ``fast`` on its state."""
    if fast is None:
        return None

    def on_first(*args) -> Any:
        *rest, state, params = args
        out = fast(*rest, state[0], params)
        if isinstance(out, UnitStep):
            return out._replace(finish=lambda: _tupled(out.finish()))
        return _tupled(out)

    return on_first


def _tupled(pair: tuple) -> tuple:
    return pair[0], (pair[1],)


# [Note: donated trees]
# JAX deletes a donated buffer; here the step returns new tensor objects on the same storage
# (``detach``: no copy) and empties the donated ones (``set_()``: zero elements, the storage
# left to the new objects), so the donated tree can no longer be used by mistake: fz3's
# checks see a tensor of no elements where a shard belongs and name ``donate=True``.


def give_up(old: Tree, new: Tree) -> Tree:
    """``new`` with every tensor it shares with ``old`` replaced by a fresh alias; those tensors
    of ``old`` emptied."""
    donated = {id(t) for t in optree.tree_leaves(old) if isinstance(t, torch.Tensor)}

    def alias(t: Any) -> Any:
        return t.detach() if isinstance(t, torch.Tensor) and id(t) in donated else t

    fresh = optree.tree_map(alias, new)
    for t in optree.tree_leaves(old):
        if isinstance(t, torch.Tensor) and t.numel() and t.dim():  # scalars (a step count) stay
            t.set_()
    return fresh


def apply_updates(params: Tree, updates: Tree) -> Tree:
    """``params + updates``, leaf by leaf (new tensors; the inputs are untouched)."""
    refuse_donated_tree(params, "params")
    check_like(params, updates, "the updates", "pass the updates that opt.update returned for "
               "these params")
    return optree.tree_map(torch.add, params, updates)


def model_comm(model: Any, fn: str) -> Any:
    """The model's ``Comm``, refusing what is not a ``ShardedModel`` (named in ``fz3.optim.<fn>``'s
    error)."""
    comm = getattr(model, "comm", None)
    if comm is None:
        raise TypeError(f"fz3.optim.{fn} takes the ShardedModel (fz3.shard's first result), got "
                        f"{type(model).__name__}: it sums over the model's sharding group, which "
                        f"a process group (the world, say) gets wrong under hybrid sharding")
    return comm
