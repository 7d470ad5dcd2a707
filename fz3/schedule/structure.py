"""What a schedule needs to know of a model: its parts, in order, and which parts each one's
compute reads. A *part* is what a model is made of (the embedding stage, a stack of
identical layers, the head); ``fz3.shard`` builds them, ``fz3.cost.Workload`` describes
them in closed form, and ``plan`` turns them into schedule units.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple, Sequence


class Role(Enum):
    """What a part's compute is."""

    PRE = "pre"  # pre(m, batch) -> h | (h, *extras): the first part
    STACK = "stack"  # k structurally identical layers, each call_layer(layer, h, *extras) -> h
    BETWEEN = "between"  # between(m, h, batch) -> h | (h, *extras): code between two stacks
    POST = "post"  # post(m, h, batch) -> loss: the last computing part, run by the loss op
    SHARED = "shared"  # parameters tied across parts: no compute of its own, read by others


FORWARD_ROLES = (Role.PRE, Role.STACK, Role.BETWEEN)


class PartShape(NamedTuple):
    name: str
    role: Role
    rows: int = 1  # layers in a stack; 1 otherwise
    reads: tuple[int, ...] = ()  # SHARED parts whose parameters this part's compute also uses
    path: str = ""  # stacks: the ModuleList's path (units are named path.<layer>); "" = name
    first: int = 0  # stacks: the index of the part's first layer in that ModuleList


def layers_only(num_layers: int) -> tuple[PartShape, ...]:
    """The simplest model: ``pre``, one stack of ``num_layers`` layers, ``post``."""
    return (PartShape("pre", Role.PRE), PartShape("layers", Role.STACK, num_layers),
            PartShape("post", Role.POST))


def check_structure(parts: Sequence[PartShape]) -> str | None:
    """Why ``parts`` cannot be scheduled, or None."""
    roles = [p.role for p in parts]
    if not parts or roles[0] is not Role.PRE or roles.count(Role.PRE) != 1:
        return f"the first part, and only it, must be PRE; roles are {[r.value for r in roles]}"
    if roles.count(Role.POST) != 1:
        return f"exactly one part must be POST; roles are {[r.value for r in roles]}"
    post = roles.index(Role.POST)
    if any(r in FORWARD_ROLES for r in roles[post:]):
        return "parts after POST may only be SHARED"
    for i, p in enumerate(parts):
        if (p.rows < (0 if p.role is Role.STACK else 1)
                or (p.role is not Role.STACK and p.rows != 1)):
            return f"part {p.name!r} has rows={p.rows}"
        bad = [r for r in p.reads if not 0 <= r < len(parts) or parts[r].role is not Role.SHARED]
        if bad:
            return f"part {p.name!r} reads {bad}, which are not SHARED parts"
    return None
