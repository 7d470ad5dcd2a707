"""An optimizer's step a unit at a time (``fz3.train_step``, ``fz3.step_through(opt=)``): a
transformation's per-unit form (``GradientTransformation.per_unit``), with what
``fz3.optim.step(..., donate=True)`` promises around it: the trees donated, every layer of
every leaf stepped exactly once, and trees stepped in part never left usable."""

from __future__ import annotations

from typing import Any

import optree
import torch

from .base import GradientTransformation, Tree, UnitStep, give_up
from .checks import refuse_donated_tree


def placement(opt: GradientTransformation) -> str | None:
    """Where ``fz3.train_step``'s schedule puts ``opt``'s update ops: ``"each"`` right after
    each unit's ``wait_reduce``, ``"last"`` after the backward (its per-unit form scales the
    whole gradient first: ``chain(clip_by_global_norm, ...)``), None where it has no per-unit
    form."""
    if opt.per_unit is None:
        return None
    return "last" if opt.per_unit_last else "each"


def per_unit(opt: GradientTransformation, params: Tree, state: Any) -> UnitStep | None:
    """``opt``'s step a unit at a time, or None where it has no per-unit form (it needs the
    whole gradient: ``clip_by_global_norm``; or is not separable by layers:
    ``freeze`` after ``adamw``, a longer ``chain``). As ``step(..., donate=True)``:
    ``params`` and ``state`` are given up, ``finish`` returns the new ones (a layer stepped
    twice, or never, is refused); ``abandon`` gives them up when the step ends after some
    layer was stepped and before ``finish`` (a rank lost, a stop): stepped in part, they
    must not be used. Local."""
    refuse_donated_tree(params, "params")
    refuse_donated_tree(state, "optimizer state")
    if opt.per_unit is None:
        return None
    inner = opt.per_unit(state, params)
    leaves = optree.tree_leaves(params)
    seen: list[set] = [set() for _ in leaves]  # per leaf: its layers stepped (None: whole)

    def update(leaf: int, layers: slice | None, grad: torch.Tensor) -> None:
        now = {None} if layers is None else set(range(layers.start, layers.stop))
        if now & seen[leaf]:
            raise ValueError(f"the optimizer's per-unit step: leaf {leaf}'s layers "
                             f"{sorted(now & seen[leaf], key=str)} stepped twice in one step "
                             f"(a schedule updates each unit once)")
        seen[leaf] |= now
        inner.update(leaf, layers, grad)

    def finish() -> tuple[Tree, Any]:
        left = [i for i, (t, got) in enumerate(zip(leaves, seen))
                if not got or (None not in got and got != set(range(t.shape[0])))]
        if left:
            raise RuntimeError(f"the optimizer's per-unit step: leaves {left} were not stepped "
                               f"whole (every unit takes one update a step)")
        new_params, new_state = inner.finish()
        return give_up(params, new_params), give_up(state, new_state)

    def abandon() -> None:
        if any(seen):
            give_up(params, None)
            give_up(state, None)

    return UnitStep(update, finish, abandon)
