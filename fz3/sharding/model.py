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
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm.arrival import DEFAULT_TIMEOUT_S
from ..comm.collectives import Comm
from ..comm.groups import comm_groups
from ..comm.liveness import Heartbeat
from ..storage import pretrained
from ..storage.pretrained import Pretrained
from ..schedule.structure import PartShape, Role
from .checks import check_not_wrapped, check_parameters, check_same_on_all_ranks, resolve_layers
from .binding import Binding
from .layout import FlatLayout
from .params import Params
from .parts import Part, Parts, partition
from .precision import Precision


PreFn = Callable[..., Any]  # (m, batch) -> h | (h, *extra)
BetweenFn = Callable[..., Any]  # (m, h, batch) -> h | (h, *extra)
PostFn = Callable[..., torch.Tensor]  # (m, h, batch) -> scalar loss
CallLayer = Callable[..., torch.Tensor]  # (layer, h, *extra) -> h


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
    # traced layer programs (``fz3.step.traced``), shared by every step function on this model
    # and its copies; keyed by the binding and layouts they were traced from, and by their
    # joint graph's code (layers traced alike share programs)
    traces: dict = field(default_factory=dict, repr=False)
    # layer binding -> whether it writes into its input h in place, learned at its first call
    # through autograd (``fz3.sharding.compute.guarded``); shared like ``traces``
    writes_input: dict = field(default_factory=dict, repr=False)

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


def shard(
    module: nn.Module,
    layers: str | Sequence[str] | None = None,
    pre: PreFn | None = None,
    post: PostFn | None = None,
    *,
    between: Sequence[BetweenFn | None] = (),
    call_layer: CallLayer | None = None,
    assign: Mapping[str, str] | None = None,
    group: dist.ProcessGroup | None = None,
    mesh: Any = None,
    device: torch.device | str | None = None,
    precision: Precision = Precision(),
    weights: str | os.PathLike | Pretrained | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> tuple[ShardedModel, Params]:
    """Shard ``module`` over ``group`` or ``mesh`` (default: the default process group).
    **Collective**: every rank must call it (one small all-gather checks the ranks agree).

    A 1-D ``DeviceMesh`` names the sharding group. A 2-D mesh ``(replicate, shard)`` gives
    hybrid sharding: parameters are sharded inside each row (dim 1) and replicated across
    rows (dim 0); gradients are reduce-scattered inside a row, then all-reduced across rows
    on the shard only.

    Args:
      module: an unchanged ``nn.Module``; it is not modified (``del`` it to free its memory).
        With none of layers/pre/post given, a built-in adapter is used (Hugging Face
        ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``RobertaForMaskedLM``: see ``fz3.hf``).
      layers: dotted path of an ``nn.ModuleList`` of layers, or a list of them in compute
        order. Consecutive structurally identical layers are stacked and scanned; a list of
        layers of several kinds (``[A, A, B, B, B]``) becomes one stack per run.
      pre: ``pre(m, batch) -> h`` or ``-> (h, *extra)``; ``m`` is the module with the
        parameters registered before the first stack substituted. Each layer is called
        ``call_layer(layer, h, *extra)``.
      post: ``post(m, h, batch) -> loss`` (a scalar), with the parameters registered after
        the last stack.
      between: with several paths, one function per gap, ``between[i](m, h, batch) -> h`` or
        ``(h, *extra)`` (new extras for the next stacks), run between stack i and i+1 with
        the parameters registered between them; None (or no ``between``) passes ``h`` and the
        extras straight on.
      call_layer: how to call one layer, ``call_layer(layer, h, *extra) -> h``; default
        ``layer(h, *extra)`` (pass one for layers that return tuples).
      assign: ``{name prefix: "pre" | "post" | "between.i"}`` for parameters whose
        registration order does not say which function uses them.
      device: where shards and compute live; default: the module's device (cuda:current for NCCL).
      precision: compute / reduce dtypes (fp32 master shards always).
      weights: a folder with a Hugging Face checkpoint (``model.safetensors`` or its sharded
        index), or a ``fz3.Pretrained`` of one (it counts the bytes read): each parameter it
        holds is read from it, only the slices this rank owns, so ``module`` may be built on
        the meta device; meta buffers are read or computed too (``fz3/storage/pretrained.py``).
        A PEFT model's base weights are found under the base model's names.
      timeout: seconds a rank waits in one of the model's collectives (gloo) before it looks
        for ranks that never entered the step call, and names them
        (``fz3.CollectiveMismatchError``); see ``fz3/comm/collectives.py``.

    Returns ``(model, params)``: the static model and this rank's fp32 shards.
    """
    check_not_wrapped(module)
    paths, pre, post, call_layer, check_batch = _functions_given(module, layers, pre, post,
                                                                 call_layer)
    if len(between) not in (0, len(paths) - 1):
        raise ValueError(f"between has {len(between)} functions for {len(paths)} stacks; pass "
                         f"one per gap ({len(paths) - 1}), None where h passes through")
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
    comm, device = _comm(module, group, mesh, device, timeout)
    betweens = [fn for fn in between if fn is not None]
    gap_has_fn = [fn is not None for fn in between] or [False] * (len(paths) - 1)
    split = partition(module, paths, comm.world_size, between=gap_has_fn, assign=assign)
    check_parameters(split, meta=weights is not None)
    skeleton = _skeleton(module, device)
    functions = _functions(split.parts, skeleton, pre, post, betweens, call_layer)
    fill = _shards if weights is None else _from_checkpoint(weights, module, skeleton, device)
    shards = tuple(fill(part, part.layout, rows, comm, device, torch.float32)
                   for part, rows in zip(split.parts, split.params))
    frozen = tuple(None if part.frozen is None
                   else fill(part, part.frozen, rows, comm, device, precision.frozen)
                   for part, rows in zip(split.parts, split.params))
    frozen_size = torch.empty((), dtype=precision.frozen).element_size()
    model = ShardedModel(Parts(split.parts, frozen_size), frozen, functions, skeleton, comm,
                         precision, device, mesh, module.training, check_batch)
    check_same_on_all_ranks(comm, split.parts, device)
    return model, Params(shards)


def _functions_given(module: nn.Module, layers, pre, post, call_layer):
    """``(paths, pre, post, call_layer, check_batch)``: the user's, or the built-in adapter's
    when none of layers/pre/post is given."""
    check_batch = None
    if layers is None and pre is None and post is None:
        from ..hf.adapters import adapter_for

        adapter = adapter_for(module)
        layers, pre, post = adapter.layers, adapter.pre, adapter.post
        call_layer = call_layer or adapter.layer
        check_batch = adapter.check_batch
    if layers is None or pre is None or post is None:
        raise TypeError("fz3.shard needs layers=, pre= and post= (or none of them, for a model "
                        "with a built-in adapter): layers='<path of the nn.ModuleList>', "
                        "pre(m, batch) -> h, post(m, h, batch) -> loss")
    paths = [layers] if isinstance(layers, str) else list(layers)
    return paths, pre, post, call_layer or _call_layer, check_batch


def _from_checkpoint(weights, module: nn.Module, skeleton: nn.Module, device: torch.device):
    """A ``_shards`` that reads each rank's slices from a checkpoint folder
    (``fz3/storage/pretrained.py``); the skeleton's meta buffers are made real first."""
    from ..hf.peft_models import checkpoint_names

    source = weights if isinstance(weights, Pretrained) else Pretrained(weights)
    names = checkpoint_names(module)
    pretrained.materialize_buffers(skeleton, source, names, device)
    return functools.partial(_shards, read=functools.partial(pretrained.piece, source, names))


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
            stack = resolve_layers(skeleton, part.path)
            out.append(tuple(Binding(call_layer, stack[part.first + j], layouts(parts, i))
                             for j in range(part.rows)))
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


def _skeleton(module: nn.Module, device: torch.device) -> nn.Module:
    """A deep copy of ``module`` whose parameters are meta tensors; buffers move to ``device``.

    The memo makes ``deepcopy`` map each parameter to its meta twin without copying its
    storage, and keeps ties (one Parameter under two names stays one).
    """
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in module.parameters()}
    skeleton = copy.deepcopy(module, memo)
    return skeleton._apply(lambda t: t if t.is_meta else t.to(device))
