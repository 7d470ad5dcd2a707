"""Freezing and unfreezing between steps: a re-shard of the current weights into new layouts.

    model, params = fz3.refreeze(model, params, trainable=lambda name: True)  # now train all
    opt_state = opt.init(params)                                              # fresh state

A part's trained and frozen parameters live in two flat buffers of different layouts (fp32
master shards in ``params``; frozen shards in ``model.frozen``, in ``precision.frozen``), so
which parameters are trained is part of the model, not a flag: changing it builds a new
``ShardedModel`` and new ``params``, and the old ones stay valid for the old model. Values
carry over: a parameter that becomes trained starts from its frozen value (in the frozen
dtype, so bf16-rounded if frozen weights are stored in bf16), one that becomes frozen is cast
to the frozen dtype.

The optimizer state is not carried: build it again with ``opt.init(params)``, so every
trained parameter, newly trained or not, starts with fresh optimizer state (zero moments,
step count 0: AdamW's one step count serves every parameter, so moments kept for some would
be bias-corrected as if they had all trained that long). Parts stay as ``fz3.shard`` made
them: the layers of one stack must all change alike (a stack has one layout for all its
layers); to freeze some layers of a stack only, shard again (``fz3.export`` then
``fz3.shard(..., weights=folder)``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..comm.collectives import all_gather, wait
from ..comm.groups import refuse_destroyed
from ..schedule.structure import Role
from .checks import check_same_on_all_ranks
from .layout import FlatLayout
from .model import Params, ShardedModel, rebind
from .params import check_tree
from .parts import Part, Parts


def refreeze(
    model: ShardedModel, params: Params, trainable: Callable[[str], bool]
) -> tuple[ShardedModel, Params]:
    """``(model, params)`` with the parameters for which ``trainable(name)`` holds trained and
    the others frozen (names: the original module's). **Collective**: per part and row, one
    all-gather of its trained shard and one of its frozen shard (a unit at a time), and one
    small all-gather to check that every rank chose the same."""
    refuse_destroyed(model.comm, "fz3.refreeze")
    check_tree(model, params, "params")
    order = {
        n: i for i, (n, _) in enumerate(model.skeleton.named_parameters(remove_duplicate=False))
    }
    plans = [_split(model, part, order, trainable) for part in model.parts]
    parts = tuple(
        part._replace(layout=trained, frozen=frozen)
        for part, (trained, frozen) in zip(model.parts, plans)
    )
    check_same_on_all_ranks(model.comm, parts, model.device)
    new_params, new_frozen = [], []
    for i, (old, new) in enumerate(zip(model.parts, parts)):
        trained = _empty(model, new, new.layout, torch.float32)
        frozen = (
            None if new.frozen is None else _empty(model, new, new.frozen, model.precision.frozen)
        )
        for row in range(old.rows):  # one row gathered at a time
            values = _gather_row(model, old, params.parts[i], model.frozen[i], row)
            _fill(model, new.layout, trained[row], values)
            if frozen is not None:
                _fill(model, new.frozen, frozen[row], values)
        new_params.append(trained if new.role is Role.STACK else trained.view(-1))
        new_frozen.append(frozen if frozen is None or new.role is Role.STACK else frozen.view(-1))
    new = dataclasses.replace(model, parts=Parts(parts, model.parts.frozen_size, model.parts.moves),
                              frozen=tuple(new_frozen),
                              functions=rebind(model.functions, parts))
    return new, Params(tuple(new_params))


def _split(model: ShardedModel, part: Part, order: dict[str, int], trainable) -> tuple:
    """The part's new (trained, frozen) layouts, slots in the module's order."""
    slots = [*part.layout.slots, *(part.frozen.slots if part.frozen is not None else ())]
    slots.sort(key=lambda s: order[part.prefix(0) + s.name])
    trained, frozen = [], []
    for s in slots:
        answers = {
            (part.prefix(row) + n): bool(trainable(part.prefix(row) + n))
            for row in range(part.rows)
            for n in s.names
        }
        if len(set(answers.values())) > 1:
            yes = next(n for n, a in answers.items() if a)
            no = next(n for n, a in answers.items() if not a)
            why = f"stack {part.name} has one layout" if part.rows > 1 else "one tied parameter"
            raise ValueError(
                f"fz3.refreeze: trainable({yes!r}) is True but trainable({no!r}) is False ({why}): "
                f"change them alike, or shard again to freeze some layers only"
            )
        meta = torch.empty(s.shape, dtype=s.dtype, device="meta")
        (trained if next(iter(answers.values())) else frozen).append((s.names, meta))
    world = model.world_size
    return FlatLayout.build(trained, world), (FlatLayout.build(frozen, world) if frozen else None)


def _gather_row(model: ShardedModel, part: Part, trained: torch.Tensor, frozen, row: int) -> dict:
    """``{slot name: full tensor}`` of one row, trained and frozen, on every rank."""
    out = {}
    pieces = [(part.layout, trained)] + ([(part.frozen, frozen)] if part.frozen is not None else [])
    for layout, shards in pieces:
        shard = shards.reshape(part.rows, -1)[row]
        full = torch.empty(layout.padded, dtype=shard.dtype, device=shard.device)
        wait(all_gather(model.comm, full, shard.contiguous(), label=f"fz3.refreeze {part.name}"))
        out.update({s.name: v for s, v in zip(layout.slots, layout.views(full))})
    return out


def _empty(model: ShardedModel, part: Part, layout: FlatLayout, dtype) -> torch.Tensor:
    return torch.zeros(part.rows, layout.shard_numel, dtype=dtype, device=model.device)


def _fill(model: ShardedModel, layout: FlatLayout, out: torch.Tensor, values: dict) -> None:
    """This rank's shard ``out`` (shard,) of one row in ``layout``, from the row's full tensors."""
    layout.fill_shard(out, model.rank, lambda s, src: values[s.name].reshape(-1)[src])
