"""What an optimizer refuses before any kernel runs: a tree (gradients, a moment, updates)
that is not shaped like the params it goes with, leaf by leaf, and a donated one.

The params are the reference: ``opt.init(params)`` built the state from them, and a state built
for other params (another model, or these params before ``fz3.refreeze`` changed a part's
shard) would otherwise reach torch's kernels: a broadcast that silently reshapes a shard, a
size error naming neither fz3 nor the state, or a fused kernel reading past a buffer
(SIGSEGV). No model identity is needed, so ``Params`` and the optax-style purity of
``init``/``update`` are unchanged; the cost is a comparison of a few shapes per part.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from ..sharding.params import is_donated

FIX_STATE = ("build the state for these params with opt.init(params) (after fz3.refreeze or a new "
             "fz3.shard the old state no longer fits)")


def refuse_donated_tree(tree: Any, what: str) -> None:
    """Raise if any tensor of ``tree`` was given up to ``fz3.optim.step(..., donate=True)``."""
    for t in optree.tree_leaves(tree):
        if is_donated(t):
            noun = what.removeprefix("the ")  # callers say "the updates"; not "use the the ..."
            raise ValueError(f"{what} was donated to fz3.optim.step(..., donate=True) or "
                             f"fz3.train_step, which updated its buffers in place and returned "
                             f"new ones: use the {noun} that it returned (params, opt_state = "
                             f"fz3.optim.step(...)); after a train_step that raised, they were "
                             f"stepped in part: load a checkpoint")


def check_like(params: Any, tree: Any, what: str, fix: str) -> None:
    """``tree`` has ``params``' structure and each of its tensors the shape, dtype and device of
    the params' tensor in its place; raise naming the part and ``fix`` otherwise."""
    refuse_donated_tree(tree, what)
    want, want_def = optree.tree_flatten(params)
    got, got_def = optree.tree_flatten(tree)
    if got_def != want_def:
        raise TypeError(f"{what} is {_shape_of(got_def, got)}, the params are "
                        f"{_shape_of(want_def, want)}: {fix}")
    for i, (p, t) in enumerate(zip(want, got)):
        if not isinstance(t, torch.Tensor) or not isinstance(p, torch.Tensor):
            continue
        if t.shape != p.shape or t.dtype != p.dtype or t.device != p.device:
            raise ValueError(f"{what} part #{i} is {_tensor(t)}, the params' part #{i} is "
                             f"{_tensor(p)} ({_named(i)}): {fix}")


def check_mask(params: Any, masks: Any) -> None:
    """Each weight-decay mask broadcasts to its params' tensor (``fz3.decay_mask(model)`` of
    this model)."""
    want, want_def = optree.tree_flatten(params)
    got, got_def = optree.tree_flatten(masks)
    fix = "build the mask from this model: fz3.decay_mask(model), and the optimizer again"
    if got_def != want_def:
        raise TypeError(f"the weight-decay mask is {_shape_of(got_def, got)}, the params are "
                        f"{_shape_of(want_def, want)}: {fix}")
    for i, (p, k) in enumerate(zip(want, got)):
        try:
            fits = torch.broadcast_shapes(k.shape, p.shape) == p.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"the weight-decay mask part #{i} is {list(k.shape)}, which does not "
                             f"broadcast to the params' part #{i} {_tensor(p)} ({_named(i)}): "
                             f"{fix}")


def _shape_of(treedef: Any, leaves: list) -> str:
    kinds = ", ".join(_tensor(x) if isinstance(x, torch.Tensor) else type(x).__name__
                      for x in leaves[:6])
    more = ", ..." if len(leaves) > 6 else ""
    return f"{treedef.num_leaves} leaves ({kinds}{more}) in {_container(treedef)}"


def _container(treedef: Any) -> str:
    text = str(treedef)
    return text if len(text) <= 80 else text[:77] + "..."


def _tensor(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}"


def _named(i: int) -> str:
    # an optimizer sees trees, not the model (optax-style): its part names are the model's
    return f"named by model.parts[{i}].name; print(model.parts) lists them"
