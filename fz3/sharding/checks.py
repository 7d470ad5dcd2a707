"""What ``fz3.shard`` refuses before it shards anything, each with the value and the fix:
a module already wrapped by DDP/FSDP, a ``layers`` path that is not a container of blocks,
parameters fz3 cannot shard, and ranks that built different models. (Layers that differ
are not refused: each run of identical ones is a stack, ``fz3/sharding/parts.py``.)"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..comm.collectives import Comm, differing_ranks
from ..comm.failures import gather_objects
from ..compare import fingerprint, first_difference
from ..schedule.structure import Role


def check_not_wrapped(module: nn.Module) -> None:
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        raise TypeError("fz3.shard got a DistributedDataParallel wrapper; pass the plain module "
                        "(ddp.module): fz3 does its own data parallelism")
    wrapped = type(module).__name__.startswith("FSDP") or any(
        type(m).__name__ == "FullyShardedDataParallel" for m in module.modules())
    dtensors = [n for n, p in module.named_parameters() if type(p).__name__ == "DTensor" or
                type(getattr(p, "data", p)).__name__ == "DTensor"]
    if wrapped or dtensors:
        raise TypeError(f"fz3.shard got a module already sharded by FSDP ({type(module).__name__}"
                        f"{', DTensor parameters such as ' + dtensors[0] if dtensors else ''}); "
                        f"pass the module before fully_shard/FSDP wrapping")


CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def resolve_layers(module: nn.Module, path: str) -> nn.Module:
    """The container of blocks at ``path``: an ``nn.ModuleList``, an ``nn.Sequential`` or an
    ``nn.ModuleDict`` (its children in iteration order), used as it is."""
    try:
        stack = module.get_submodule(path)
    except AttributeError:
        children = [n for n, m in module.named_modules() if isinstance(m, CONTAINERS) and n]
        raise ValueError(f"layers={path!r} does not name a submodule of {type(module).__name__}; "
                         f"containers of blocks in it: {children or 'none'}") from None
    if not isinstance(stack, CONTAINERS):
        raise TypeError(f"layers={path!r} is a {type(stack).__name__}, not a container of blocks "
                        f"(nn.ModuleList, nn.Sequential or nn.ModuleDict)")
    return stack


def layer_children(module: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` of each child of the container at ``path``, in iteration order: the
    name is the block's key in parameter names (``blocks.3.fc.weight``, ``layers.attn_0.w``).
    One module object held twice (ALBERT's shared layer) is listed twice (``named_children``
    would list it once), so the partition refuses its shared parameters by name."""
    return [(k, m) for k, m in resolve_layers(module, path)._modules.items() if m is not None]


def check_path_order(module: nn.Module, paths: Sequence[str]) -> None:
    """The stacks of ``layers=`` listed in registration order (fz3 takes it as compute order)."""
    order = []
    for name, _ in module.named_parameters(remove_duplicate=False):
        for i, path in enumerate(paths):
            if name.startswith(path + ".") and i not in order:
                order.append(i)
    if order != sorted(order):
        raise ValueError(f"layers={list(paths)}: the stacks must be listed in the order the "
                         f"module registers them ({[paths[i] for i in order]}), which fz3 takes "
                         f"as compute order")


def check_parameters(split, meta: bool = False) -> None:
    """Floating point and materialized (``meta``: meta ones are allowed, for ``weights=`` to
    fill): what fz3 can shard (``split``: a ``Partition``)."""
    for part, rows in zip(split.parts, split.params):
        for j, row in enumerate(rows):
            for names, p in row:
                name = part.prefix(j) + names[0]
                if not p.is_floating_point():
                    raise TypeError(f"parameter {name} has dtype {p.dtype}; fz3 shards "
                                    f"floating-point parameters only")
                if p.is_meta and not meta:
                    raise ValueError(f"parameter {name} is on the meta device; materialize the "
                                     f"module (e.g. module.to_empty(device=...) and initialize it) "
                                     f"before fz3.shard, or pass weights='<folder of its "
                                     f"checkpoint>'")


def check_same_on_all_ranks(comm: Comm, parts, device: torch.device) -> None:
    """Every rank must have built the same parts, or collectives hang. On a mismatch, every
    rank raises, naming the ranks and the first differing parameter. **Collective**: one small
    all-gather (and one more on a mismatch)."""
    mine = []
    for part in parts:
        mine.append((f"part {part.name}", part.role.value, f"rows {part.rows}"))
        for frozen, layout in ((False, part.layout), (True, part.frozen)):
            mine += [(f"{part.path}.*.{s.name}" if part.role is Role.STACK else s.name,
                      str(list(s.shape)), str(s.dtype).removeprefix("torch."),
                      *(("frozen",) if frozen else ()))
                     for s in getattr(layout, "slots", ())]
    differ, _ = differing_ranks(comm, list(fingerprint(mine)), device, "fz3.shard's model check")
    if not differ:
        return
    everyone = gather_objects(comm.group, mine)
    r = differ[0]
    _, a, b = first_difference(everyone[0], everyone[r]) or (0, None, None)
    show = lambda d: "nothing" if d is None else " ".join(str(x) for x in d)  # noqa: E731
    raise ValueError(f"ranks {differ} built a different model than rank 0: rank 0 has {show(a)}, "
                     f"rank {r} has {show(b)}. Every rank must call fz3.shard on the same "
                     f"architecture and dtypes")
