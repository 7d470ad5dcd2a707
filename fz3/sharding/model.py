"""``fz3.shard``: an unchanged ``nn.Module`` -> (static ``ShardedModel``, local ``Params``).

The module is split into parts (``fz3/sharding/parts.py``): ``pre``, one stack per run of
structurally identical layers, ``between`` parts, ``post`` and parts of tied parameters.
Each part's rows become flat buffers (``FlatLayout``); this rank keeps its 1/N shard of
each, in fp32. The module itself is not modified: fz3 keeps a skeleton copy whose
parameters live on the meta device and substitutes gathered parameters into it with
``torch.func.functional_call``.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import Comm
from ..comm.groups import comm_groups
from ..comm.liveness import Heartbeat
from ..schedule.structure import PartShape, Role
from .checks import check_not_wrapped, check_parameters, check_same_on_all_ranks, layer_children
from .binding import Binding
from .layout import FlatLayout
from .params import Params
from .parts import Part, Partition, Parts, partition
from .precision import Precision
from .unreachable import unreachable
from . import placement


log = logging.getLogger("fz3")

PreFn = Callable[..., Any]  # (m, batch) -> h | (h, *extra)
BetweenFn = Callable[..., Any]  # (m, h, batch) -> h | (h, *extra)
PostFn = Callable[..., torch.Tensor]  # (m, h, batch) -> scalar loss
CallLayer = Callable[..., torch.Tensor]  # (layer, h, *extra) -> h, or (h, aux) (layer_aux)


def _call_layer(layer: nn.Module, h: torch.Tensor, *extra: Any) -> torch.Tensor:
    return layer(h, *extra)


@dataclass(frozen=True, eq=False)
class ShardedModel:
    """Everything static about a sharded model: parts, skeleton, functions, group."""

    parts: Parts  # a tuple of Part; print(model.parts) shows a table
    frozen: tuple[torch.Tensor | None, ...]  # per part: this rank's shard of its frozen parameters,
    # (shard,) or (k, shard) in precision.frozen; None where none is frozen. Constant, like buffers.
    functions: tuple[Any, ...]  # per part: a Binding (pre/between/post), a tuple of them per layer
    # (stacks: call_layer bound to each layer of the skeleton), None (shared parts)
    skeleton: nn.Module  # the module with meta parameters (and real buffers)
    comm: Comm
    precision: Precision
    device: torch.device
    mesh: Any = None  # the DeviceMesh given to fz3.shard, if any (checkpoints use it)
    training: bool = True  # dropout and the like on; set per model copy, never in place
    # the adapter's batch check (local), if any: raises, or says why a batch is empty (or None)
    check_batch: Callable[[Any], str | None] | None = None
    # the adapter's outputs beside the loss, ``name -> fn(m, h, batch)`` with post's parameters
    # (``fz3.apply(..., output="logits")``); empty for a model sharded with pre/post given
    outputs: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    # traced layer programs (``fz3.step.traced``), shared by every step function on this model
    # and its copies; keyed by the binding and layouts they were traced from, and by their
    # joint graph's code (layers traced alike share programs)
    traces: dict = field(default_factory=dict, repr=False)
    # layer binding -> whether it writes into its input h in place, learned at its first call
    # through autograd (``fz3.sharding.compute.guarded``); shared like ``traces``
    writes_input: dict = field(default_factory=dict, repr=False)
    # every layer returns ``(h, aux)``: its aux outputs, stacked per stack, go to the loss as
    # a fourth argument (``fz3.facade``'s ``layer_aux``)
    layer_aux: bool = False

    @property
    def structure(self) -> tuple[PartShape, ...]:
        """What a schedule needs to know of the model (``fz3.plan`` reads it)."""
        return tuple(p.shape for p in self.parts)

    @property
    def numel(self) -> int:
        """Parameters in the model (tied ones once), frozen ones included."""
        return sum(p.rows * (p.layout.numel + (p.frozen.numel if p.frozen else 0))
                   for p in self.parts)

    @property
    def trained_numel(self) -> int:
        return sum(p.rows * p.layout.numel for p in self.parts)

    @property
    def num_layers(self) -> int:
        return sum(p.rows for p in self.parts if p.role is Role.STACK)

    @property
    def post(self) -> Binding:
        return self.functions[self.part_index("post")]

    def part_index(self, name: str) -> int:
        for i, p in enumerate(self.parts):
            if p.name == name:
                return i
        raise KeyError(f"no part named {name!r}; parts are {[p.name for p in self.parts]}")

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def is_root(self) -> bool:
        """Global rank 0: the one rank that keeps gathered state dicts (one per job, not per
        replica)."""
        return dist.get_rank() == 0

    def train(self, mode: bool = True) -> "ShardedModel":
        """A copy of this model in training mode (``mode=False``: eval); this one is unchanged.

        As with equinox's ``inference_mode``: step functions built on a model and on its
        ``eval()`` copy share the skeleton and the shards' layout, and each step runs in its
        own model's mode."""
        return dataclasses.replace(self, training=mode)

    def eval(self) -> "ShardedModel":
        return self.train(False)

    def bind_loss(self, fn: Callable[..., Any]) -> Binding:
        """``fn(m, h, batch)`` bound to the skeleton with post's parameters, like ``post``."""
        return Binding(fn, self.skeleton, layouts(self.parts, self.part_index("post")))


# read(skeleton, device) -> piece(part, row, slot, param, elements): where a model's shards
# come from when not from the module's own tensors (a checkpoint: ``fz3.facade``)
Reader = Callable[[nn.Module, torch.device], Callable[..., torch.Tensor]]


def build(module: nn.Module, paths: Sequence[str], pre: PreFn, post: PostFn,
          call_layer: CallLayer | None, *, check_batch: Callable[[Any], str | None] | None,
          outputs: Mapping[str, Callable[..., Any]] | None = None,
          between: Sequence[BetweenFn | None], assign: Mapping[str, str] | None,
          group: dist.ProcessGroup | None, mesh: Any, device: torch.device | str | None,
          precision: Precision, read: Reader | None,
          timeout: float, layer_aux: bool = False,
          example: Any = None, example_made: bool = False) -> tuple[ShardedModel, Params]:
    """``fz3.shard`` once its adapter and checkpoint reader are resolved (``fz3.facade``, which
    documents the arguments). **Collective**: one small all-gather checks the ranks agree."""
    check_not_wrapped(module)
    if len(between) not in (0, len(paths) - 1):
        raise ValueError(f"between has {len(between)} functions for {len(paths)} stacks; pass "
                         f"one per gap ({len(paths) - 1}), None where h passes through")
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
    comm, device = _comm(module, group, mesh, device, timeout)
    betweens = [fn for fn in between if fn is not None]
    gap_has_fn = [fn is not None for fn in between] or [False] * (len(paths) - 1)
    used = None if example is None else _used(module, paths, pre, post, between,
                                              call_layer or _call_layer, example, layer_aux,
                                              device, example_made)
    split = partition(module, paths, comm.world_size, between=gap_has_fn, assign=assign, used=used)
    if used is not None:
        _say_unread(module, paths, used)
    check_parameters(split, meta=read is not None)
    skeleton = _skeleton(module, device, split)
    functions = _functions(split.parts, skeleton, pre, post, betweens,
                           call_layer or _call_layer)
    fill = _shards if read is None else functools.partial(_shards, read=read(skeleton, device))
    shards = tuple(fill(part, part.layout, rows, comm, device, torch.float32)
                   for part, rows in zip(split.parts, split.params))
    frozen = tuple(None if part.frozen is None
                   else fill(part, part.frozen, rows, comm, device, precision.frozen)
                   for part, rows in zip(split.parts, split.params))
    frozen_size = torch.empty((), dtype=precision.frozen).element_size()
    model = ShardedModel(Parts(split.parts, frozen_size, split.moves), frozen, functions, skeleton,
                         comm, precision, device, mesh, module.training, check_batch,
                         dict(outputs or {}), layer_aux=bool(layer_aux))
    check_same_on_all_ranks(comm, split.parts, device)
    return model, Params(shards)


def _used(module, paths, pre, post, between, call_layer, example, layer_aux, device,
          made: bool) -> Mapping[str, set[str]] | None:
    """``placement.reads`` on the example; on one a built-in adapter made (``made``), a
    function that fails on it leaves registration order and the adapter's ``assign=``, said
    at INFO (the user's own example raises instead)."""
    try:
        return placement.reads(module, paths, pre, post, between, call_layer, example,
                               layer_aux, device)
    except placement.PlacementError as e:
        if not made:
            raise
        log.info("fz3.shard: parameters follow registration and the adapter's assign= (%s)", e)
        return None


def _say_unread(module: nn.Module, paths: Sequence[str], used: Mapping[str, set[str]]) -> None:
    """Once, at INFO: the parameters no function read on the example (kept where registered)."""
    unread = [n for n, _ in module.named_parameters(remove_duplicate=False) if n not in used]
    if unread and dist.get_rank() == 0:
        log.info("fz3.shard: no function read %d parameter(s) on the example batch, kept where "
                 "they are registered: %s", len(unread), ", ".join(unread[:8]) +
                 (", ..." if len(unread) > 8 else ""))


def _comm(module: nn.Module, group, mesh, device, timeout: float) -> tuple[Comm, torch.device]:
    """The groups (``fz3/comm/groups.py``: collective, every row's groups in one order on every
    rank) and the device; waits bounded by ``timeout`` on gloo."""
    groups = comm_groups(group, mesh)
    backend = dist.get_backend(groups.group)
    bound = datetime.timedelta(seconds=timeout) if backend == "gloo" else None
    comm = Comm(**groups._asdict(), heartbeat=Heartbeat(), step_timeout=bound)
    device = torch.device(device) if device is not None else _default_device(module, backend)
    return comm, device


def layouts(parts: Sequence[Part], i: int) -> list[FlatLayout]:
    """What part ``i``'s function is called with, one tensor per slot, in this order: its
    trained parameters, its frozen ones, then those of each shared part it reads."""
    out = []
    for v in (i, *parts[i].reads):
        out += [parts[v].layout] + ([parts[v].frozen] if parts[v].frozen is not None else [])
    return out


def rebind(functions: tuple[Any, ...], parts: Sequence[Part]) -> tuple[Any, ...]:
    """``functions`` (one entry per part, as ``ShardedModel.functions``) called with the
    parameters of ``parts``' layouts: a binding knows which slot each name is in, so new
    trained/frozen layouts need new bindings."""
    return tuple(
        None if fn is None
        else tuple(b.rebound(layouts(parts, i)) for b in fn) if isinstance(fn, tuple)
        else fn.rebound(layouts(parts, i))
        for i, fn in enumerate(functions))


def _functions(parts: Sequence[Part], skeleton: nn.Module, pre, post, betweens,
               call_layer) -> tuple[Any, ...]:
    gaps = iter(betweens)
    out: list[Any] = []
    for i, part in enumerate(parts):
        if part.role is Role.STACK:
            stack = dict(layer_children(skeleton, part.path))
            out.append(tuple(Binding(call_layer, stack[key], layouts(parts, i))
                             for key in part.keys))
        elif part.role is Role.SHARED:
            out.append(None)
        else:
            fn = {Role.PRE: pre, Role.POST: post}.get(part.role) or next(gaps)
            out.append(Binding(fn, skeleton, layouts(parts, i)))
    return tuple(out)


def _shards(part: Part, layout: FlatLayout, rows, comm: Comm, device: torch.device,
            dtype: torch.dtype, read: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """This rank's shard of each row's parameters in ``layout``: ``(shard,)``, or ``(k, shard)``
    for a stack; only the elements this rank owns are copied, from the module's tensors, or
    from ``read(part, row, slot, param, elements)`` (a checkpoint: ``pretrained.piece``)."""
    out = torch.zeros(part.rows, layout.shard_numel, dtype=dtype, device=device)  # padding: 0
    for j, row in enumerate(rows):
        named = {names[0]: p for names, p in row}
        layout.fill_shard(out[j], comm.rank, lambda s, src: (
            named[s.name].detach().reshape(-1)[src] if read is None
            else read(part, j, s, named[s.name], src)))
    return out if part.role is Role.STACK else out.view(-1)


def _default_device(module: nn.Module, backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    p = next(module.parameters(), None)
    return p.device if p is not None and not p.is_meta else torch.device("cpu")


def _skeleton(module: nn.Module, device: torch.device, split: Partition) -> nn.Module:
    """A deep copy of ``module`` whose parameters are ``Unreachable`` placeholders naming their
    part (``fz3/sharding/unreachable.py``); buffers move to ``device``.

    The memo makes ``deepcopy`` map each parameter to its meta twin without copying its
    storage, and keeps ties (one Parameter under two names stays one).
    """
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in module.parameters()}
    skeleton = copy.deepcopy(module, memo)._apply(lambda t: t if t.is_meta else t.to(device))
    part_of = {part.prefix(j) + name: part.name
               for part, rows in zip(split.parts, split.params)
               for j, row in enumerate(rows) for names, _ in row for name in names}
    unreachable(skeleton, part_of)
    return skeleton
