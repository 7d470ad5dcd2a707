"""``fz3.shard``: an unchanged ``nn.Module`` -> (static ``ShardedModel``, ``Params`` of local shards).

The module is split into the outer unit (every parameter outside the layer stack) and the
layers (structurally identical blocks of an ``nn.ModuleList``). Each unit becomes one flat
buffer (``FlatLayout``); this rank keeps its 1/N shard of each, in fp32. The module itself
is not modified: fz3 keeps a skeleton copy whose parameters live on the meta device and
substitutes gathered parameters into it with ``torch.func.functional_call``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import Comm
from ..comm.groups import comm_groups
from ..comm.liveness import Heartbeat
from .checks import check_identical, check_not_wrapped, check_same_on_all_ranks, resolve_layers
from .layout import FlatLayout
from .precision import Precision


class Params(NamedTuple):
    """This rank's shards, an optree pytree (NamedTuples are pytree nodes).

    Gradients and optimizer state have exactly this structure.
    """

    outer: torch.Tensor  # (outer.shard_numel,)           fp32
    layers: torch.Tensor  # (num_layers, layer.shard_numel) fp32: the stack, like JAX's scan-over-layers


PreFn = Callable[..., Any]  # (m, batch) -> h | (h, *extra)
PostFn = Callable[..., torch.Tensor]  # (m, h, batch) -> scalar loss
LayerFn = Callable[..., torch.Tensor]  # (block, h, *extra) -> h


class _Bound(nn.Module):
    """Calls ``fn(m, *args)``; lets ``functional_call`` substitute ``m``'s parameters (names ``m.*``)."""

    def __init__(self, fn: Callable[..., Any], m: nn.Module):
        super().__init__()
        self.fn = fn
        self.m = m

    def forward(self, *args: Any) -> Any:
        return self.fn(self.m, *args)


def _call_block(block: nn.Module, h: torch.Tensor, *extra: Any) -> torch.Tensor:
    return block(h, *extra)


@dataclass(frozen=True, eq=False)
class ShardedModel:
    """Everything static about a sharded model: layouts, skeleton, functions, group."""

    outer: FlatLayout
    layer: FlatLayout
    num_layers: int
    layers_path: str
    pre: _Bound  # pre_fn bound to the skeleton
    post: _Bound  # post_fn bound to the skeleton
    blocks: tuple[_Bound, ...]  # layer_fn bound to each skeleton block
    skeleton: nn.Module  # the module with meta parameters (and real buffers)
    comm: Comm
    precision: Precision
    device: torch.device
    mesh: Any = None  # the DeviceMesh given to fz3.shard, if any (checkpoints use it)

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def is_root(self) -> bool:
        """Global rank 0: the one rank that keeps gathered state dicts (one per job, not per replica)."""
        return dist.get_rank() == 0

    def outer_names(self) -> list[str]:
        return [n for s in self.outer.slots for n in s.names]

    def layer_names(self, i: int) -> list[str]:
        return [f"{self.layers_path}.{i}.{n}" for s in self.layer.slots for n in s.names]

    def train(self, mode: bool = True) -> "ShardedModel":
        """Set the skeleton's training mode (dropout on/off); returns self."""
        self.skeleton.train(mode)
        return self

    def eval(self) -> "ShardedModel":
        return self.train(False)


def shard(
    module: nn.Module,
    layers: str | None = None,
    pre: PreFn | None = None,
    post: PostFn | None = None,
    *,
    layer: LayerFn | None = None,
    group: dist.ProcessGroup | None = None,
    mesh: Any = None,
    device: torch.device | str | None = None,
    precision: Precision = Precision(),
) -> tuple[ShardedModel, Params]:
    """Shard ``module`` over ``group`` or ``mesh`` (default: the default process group).

    A 1-D ``DeviceMesh`` names the sharding group. A 2-D mesh ``(replicate, shard)`` gives
    hybrid sharding: parameters are sharded inside each row (dim 1) and replicated across
    rows (dim 0); gradients are reduce-scattered inside a row, then all-reduced across rows
    on the shard only.

    Args:
      module: an unchanged ``nn.Module``; it is not modified (``del`` it to free its memory).
        With none of layers/pre/post given, a built-in adapter is used (Hugging Face
        ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``RobertaForMaskedLM``: see ``fz3.hf``).
      layers: dotted path of the ``nn.ModuleList`` of structurally identical blocks.
      pre: ``pre(m, batch) -> h`` or ``-> (h, *extra)``; ``m`` is the module with the outer
        unit's parameters substituted.
      post: ``post(m, h, batch) -> loss`` (a scalar).
      layer: optional ``layer(block, h, *extra) -> h``; default calls ``block(h, *extra)``.
      device: where shards and compute live; default: the module's device (cuda:current for NCCL).
      precision: compute / reduce dtypes (fp32 master shards always).

    Returns ``(model, params)``: the static model and this rank's fp32 shards.
    """
    if layers is None and pre is None and post is None:
        from ..hf.adapters import adapter_for

        adapter = adapter_for(module)
        layers, pre, post, layer = adapter.layers, adapter.pre, adapter.post, layer or adapter.layer
    if layers is None or pre is None or post is None:
        raise TypeError("fz3.shard needs layers=, pre= and post= (or none of them, for a model with a built-in "
                        "adapter): layers='<path of the nn.ModuleList>', pre(m, batch) -> h, post(m, h, batch) -> loss")
    check_not_wrapped(module)
    groups = comm_groups(group, mesh)  # collective: every row's groups, in one order on every rank
    comm = Comm(**groups._asdict(), heartbeat=Heartbeat())
    rank, world = comm.rank, comm.world_size
    backend = dist.get_backend(comm.group)
    device = torch.device(device) if device is not None else _default_device(module, backend)

    stack = resolve_layers(module, layers)
    block_params = [_named_params(b) for b in stack]
    check_identical(layers, block_params)
    layer_ids = {id(p) for ps in block_params for _, p in ps}
    outer_params = [(names, p) for names, p in _named_params(module) if id(p) not in layer_ids]
    for names, p in _named_params(module):
        if id(p) in layer_ids and any(not n.startswith(layers + ".") for n in names):
            raise ValueError(f"parameter {names} is used both inside {layers!r} and outside it; fz3 "
                             f"shards layers and the outer unit separately: untie it or move it")
    seen: dict[int, str] = {}
    for i, ps in enumerate(block_params):
        for names, p in ps:
            if id(p) in seen:
                raise ValueError(f"{layers}.{i}.{names[0]} is the same Parameter as {seen[id(p)]}; "
                                 f"blocks of the stack must not share parameters")
            seen[id(p)] = f"{layers}.{i}.{names[0]}"
    for names, p in outer_params + [x for ps in block_params for x in ps]:
        if not p.is_floating_point():
            raise TypeError(f"parameter {names[0]} has dtype {p.dtype}; fz3 shards floating-point parameters only")
        if not p.requires_grad:
            raise ValueError(f"parameter {names[0]} has requires_grad=False; fz3 trains every parameter. "
                             f"Register frozen tensors as buffers, or mask their updates in the optimizer")
        if p.is_meta:
            raise ValueError(f"parameter {names[0]} is on the meta device; materialize the module "
                             f"(e.g. module.to_empty(device=...) and initialize it) before fz3.shard")

    outer_layout = FlatLayout.build(outer_params, world)
    layer_layout = FlatLayout.build(block_params[0], world) if stack else FlatLayout.build([], world)
    lo, s_o = rank * outer_layout.shard_numel, outer_layout.shard_numel
    outer_shard = _flat(outer_layout, outer_params, device)[lo : lo + s_o].clone()
    s_l = layer_layout.shard_numel
    layer_shards = torch.empty(len(stack), s_l, dtype=torch.float32, device=device)
    for i, ps in enumerate(block_params):  # one unit at a time: peak extra memory is one layer
        layer_shards[i].copy_(_flat(layer_layout, ps, device)[rank * s_l : (rank + 1) * s_l])

    skeleton = _skeleton(module, device)
    skel_stack = resolve_layers(skeleton, layers)
    layer_fn = layer or _call_block
    model = ShardedModel(
        outer=outer_layout,
        layer=layer_layout,
        num_layers=len(stack),
        layers_path=layers,
        pre=_Bound(pre, skeleton),
        post=_Bound(post, skeleton),
        blocks=tuple(_Bound(layer_fn, b) for b in skel_stack),
        skeleton=skeleton,
        comm=comm,
        precision=precision,
        device=device,
        mesh=mesh,
    )
    check_same_on_all_ranks(model)
    return model, Params(outer_shard, layer_shards)


def _default_device(module: nn.Module, backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _named_params(module: nn.Module) -> list[tuple[tuple[str, ...], nn.Parameter]]:
    """``(all names, param)`` in first-appearance order; tied parameters appear once."""
    by_id: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), ([], p))[0].append(name)
    return [(tuple(names), p) for names, p in by_id.values()]


def _flat(layout: FlatLayout, params, device) -> torch.Tensor:
    return layout.flatten({names[0]: p for names, p in params}, torch.float32, device)


def _skeleton(module: nn.Module, device: torch.device) -> nn.Module:
    """A deep copy of ``module`` whose parameters are meta tensors; buffers move to ``device``.

    The memo makes ``deepcopy`` map each parameter to its meta twin without copying its
    storage, and keeps ties (one Parameter under two names stays one).
    """
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in module.parameters()}
    skeleton = copy.deepcopy(module, memo)
    return skeleton._apply(lambda t: t if t.is_meta else t.to(device))
