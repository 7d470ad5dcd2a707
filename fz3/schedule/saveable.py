"""What a layer unit's forward keeps for its backward: one predicate over the nodes of its
layer's joint graph, as JAX's ``everything_saveable`` / ``nothing_saveable`` /
``dots_saveable`` (``jax.checkpoint_policies``) and haliax's scan checkpoint policy.

A predicate is called on each op of a traced layer's forward (an ``fx.Node`` whose
``target`` is an ATen op, ``torch.ops.aten.mm.default``): True, its output is kept until the
backward; False, the backward computes it again from what is kept (``fz3.step.partition``,
[Note: selective recompute]; an op that draws random numbers or writes in place is kept and
not asked). Three are built in:

- ``save``: everything (what autograd saves): the unit keeps its layers' residuals;
- ``recompute``: nothing: the unit keeps only its input and RNG state, and its backward runs
  its whole forward again (the unit's, not each op's: a k-layer unit keeps one input);
- ``selective``: the outputs of the compute-heavy ops (``HEAVY_OPS``: matrix products,
  attention, convolutions); ``fz3.keep(ops=[...])`` names others (a ``Keep``).

``Policy(activations=fn)`` takes a predicate of your own; a forward op carries its unit's
(``fz3.schedule.ops.Op.saves``), and a schedule prints and fingerprints it by ``name_of``
(a function's module and ``__qualname__``; define one once: programs are traced per
predicate, and it must be hashable). A layer that is not traced (``trace=False``, or one that
cannot be) runs ``save`` and ``recompute`` as such and any other predicate as ``recompute``.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable, NamedTuple

import torch

# the ops whose outputs ``selective`` keeps: matrix products, attention, convolutions (ATen
# names, ``op_name``)
HEAVY_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_grouped_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math", "_flash_attention_forward",
    "_efficient_attention_forward"})

Saveable = Callable[[torch.fx.Node], bool]  # True: the node's output is kept for the backward


def save(node: torch.fx.Node) -> bool:
    """Everything is kept (autograd's residuals)."""
    return True


def recompute(node: torch.fx.Node) -> bool:
    """Nothing is kept but the unit's input: its backward runs its forward again."""
    return False


def op_name(node: torch.fx.Node) -> str:
    """An ATen op's name without namespace and overload: ``aten.mm.default`` -> ``mm``."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


class Keep(NamedTuple):
    """Keep the outputs of these ops (ATen names: ``"mm"``,
    ``"_scaled_dot_product_flash_attention_for_cpu"``), recompute the rest (``fz3.keep``)."""

    ops: frozenset[str]

    def __call__(self, node: torch.fx.Node) -> bool:
        return op_name(node) in self.ops


selective = Keep(HEAVY_OPS)


def name_of(saves: Saveable) -> str:
    """How a schedule prints and fingerprints a predicate: the same on every rank. A function
    by its module and qualified name, a dataclass instance by its module and ``repr``, a
    ``Keep`` by its ops, sorted; anything else has no name that is sure to be the same on every
    rank: a ``TypeError`` says how to give it one."""
    if saves is save or saves is recompute:
        return saves.__name__
    if isinstance(saves, Keep):
        return "selective" if saves == selective else f"keep({', '.join(sorted(saves.ops))})"
    if isinstance(saves, (types.FunctionType, types.BuiltinFunctionType)):
        return f"{saves.__module__}.{saves.__qualname__}"
    if dataclasses.is_dataclass(saves) and type(saves).__dataclass_params__.repr:
        return f"{type(saves).__module__}.{saves!r}"
    raise TypeError(f"activations={saves!r}: a predicate must have a name that is the same on "
                    f"every rank (schedules are compared across ranks): use a function (def), "
                    f"a frozen dataclass with __call__, or fz3.keep(ops=[...])")


def problem(saves: object) -> str | None:
    """Why ``saves`` cannot be a predicate (None: it can): not callable, no name that is the
    same on every rank (``name_of``), or not hashable (programs are kept per predicate)."""
    if not callable(saves):
        return f"saves={saves!r} is not callable: a predicate takes a torch.fx.Node"
    try:
        name = name_of(saves)
    except TypeError as e:
        return str(e)
    try:
        hash(saves)
    except TypeError as e:
        return (f"activations={name} is not hashable ({e}; programs are kept per "
                f"predicate): use a function (def), a frozen dataclass with __call__, or "
                f"fz3.keep(ops=[...])")
    return None


def keeps(saves: Saveable, node: torch.fx.Node) -> bool:
    """``saves(node)``; a predicate that raises is named with the node it failed on."""
    try:
        return bool(saves(node))
    except Exception as e:
        raise TypeError(f"the activation predicate {name_of(saves)} raised "
                        f"{type(e).__name__}: {e} on the node {node.format_node()}: a "
                        f"predicate takes a torch.fx.Node (node.target an ATen op, "
                        f"torch.ops.aten.mm.default) and returns whether to keep its "
                        f"output") from e


def cuts(saves: Saveable) -> bool:
    """Whether ``saves`` cuts a traced layer's programs its own way (neither ``save`` nor
    ``recompute``): a layer that is not traced runs such a unit as ``recompute``."""
    return saves is not save and saves is not recompute
