"""``fz3.shard``: the façade. It resolves what ``fz3.sharding`` must not know of (a built-in
Hugging Face adapter, ``fz3.hf``; a checkpoint to read the shards from, ``fz3.storage``) and
hands them down to ``fz3.sharding.model.build``.

``fz3.shard(module, layers=None, pre=None, post=None, *, between=(), call_layer=None,
assign=None, group=None, mesh=None, device=None, precision=Precision(), weights=None,
timeout=120, layer_aux=None, example=None)``, its arguments:

- module: an unchanged ``nn.Module``; it is not modified (``del`` it to free its memory).
  With none of layers/pre/post given, a built-in adapter is used (Hugging Face models, by
  ``config.model_type`` and head, else a ``...ForCausalLM`` matched by structure and verified:
  ``fz3.hf.adapters``); a model with none is refused naming the layer containers it holds
  (``fz3.sharding.candidates``).
- layers: dotted path of a container of layers (``nn.ModuleList``, ``nn.Sequential``, or
  ``nn.ModuleDict`` in iteration order; used as it is), or a list of them in compute order.
  Consecutive structurally identical layers are stacked and scanned; a list of layers of
  several kinds (``[A, A, B, B, B]``) becomes one stack per run.
- pre: ``pre(m, batch) -> h`` or ``-> (h, *extra)``; ``m`` is the module with the parameters
  registered before the first stack substituted. Each layer is called
  ``call_layer(layer, h, *extra)``.
- post: ``post(m, h, batch) -> loss`` (a scalar), with the parameters registered after the
  last stack; with ``layer_aux``, ``post(m, h, batch, aux)``.
- between: with several paths, one function per gap, ``between[i](m, h, batch) -> h`` or
  ``(h, *extra)`` (new extras for the next stacks), run between stack i and i+1 with the
  parameters registered between them; None (or no ``between``) passes ``h`` and the extras
  straight on.
- call_layer: how to call one layer, ``call_layer(layer, h, *extra) -> h``; default
  ``layer(h, *extra)`` (pass one for layers that return tuples; a container whose children
  have no ``forward`` of their own, each an ``nn.ModuleList``, is refused without it).
- assign: ``{name prefix: "pre" | "post" | "between.i"}`` for parameters whose registration
  order does not say which function uses them; added to a built-in adapter's own (OPT's final
  norm).
- group, mesh: the sharding group (default: the default process group). A 1-D
  ``DeviceMesh`` names it; a 2-D mesh ``(replicate, shard)`` gives hybrid sharding:
  parameters are sharded inside each row (dim 1) and replicated across rows (dim 0);
  gradients are reduce-scattered inside a row, then all-reduced across rows on the shard.
- device: where shards and compute live; default: the module's device (cuda:current for
  NCCL).
- precision: compute / reduce dtypes (fp32 master shards always).
- weights: a folder with a Hugging Face checkpoint (``model.safetensors`` or its sharded
  index), or a ``fz3.Pretrained`` of one (it counts the bytes read): each parameter it holds
  is read from it, only the slices this rank owns, so ``module`` may be built on the meta
  device; meta buffers are read or computed too (``fz3/storage/pretrained.py``). A PEFT
  model's base weights are found under the base model's names, a weight the release renames
  on load under the checkpoint's, and stacked MoE experts from their per-expert tensors
  (``fz3/hf/checkpoint_names.py``).
- layer_aux: every layer returns ``(h, aux)``, ``aux`` a small tensor of one shape per stack
  (an MoE router's statistics): the loss (``post``, or ``value_and_grad``'s ``loss=``) is
  called ``fn(m, h, batch, aux)`` with ``aux`` a tuple, one ``(layers, *shape)`` tensor per
  stack in compute order, and its gradient flows back into each layer's backward. None: the
  built-in adapter's (True for an MoE model with ``config.output_router_logits``), else False.
- example: a batch as the step will get it (this rank's): each function is run once on fake
  tensors of it (shapes only, no math) and each parameter outside the stacks goes to the part
  whose function reads it, a shared part when several do (``fz3/sharding/placement.py``);
  ``assign=`` still wins, and a parameter nothing reads stays where it is registered. A
  built-in adapter makes one from the config (a row of 8 tokens) when none is given, its
  ``assign=`` first. Without one, parts follow registration order. Either way a function
  that reads a parameter of another part raises ``PartReadError`` naming it, at the call
  (never a silent wrong value).
- timeout: seconds a rank waits in one of the model's collectives (gloo) before it looks for
  ranks that are not in the same fz3 call (a step call behind or ahead, in ``fz3.save``,
  ended), and names where each is (``fz3.CollectiveMismatchError``); see
  ``fz3/comm/collectives.py`` and ``fz3/comm/out_of_step.py``.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Literal, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .sharding.candidates import check_callable
from .comm.arrival import DEFAULT_TIMEOUT_S
from .hf.adapters import adapter_for
from .hf.batch import example as hf_example
from .hf.checkpoint_names import checkpoint_names
from .hf.peft_merge import merge_for
from .sharding.model import (BetweenFn, CallLayer, Params, PostFn, PreFn, Reader, ShardedModel,
                             build)
from .sharding.checks import check_not_wrapped
from .sharding.precision import Precision
from .storage import pretrained
from .storage.export import ExportReport
from .storage.export import export as export_units
from .storage.pretrained import Pretrained


def shard(module: nn.Module, layers: str | Sequence[str] | None = None,
          pre: PreFn | None = None, post: PostFn | None = None, *,
          between: Sequence[BetweenFn | None] = (), call_layer: CallLayer | None = None,
          assign: Mapping[str, str] | None = None, group: dist.ProcessGroup | None = None,
          mesh: Any = None, device: torch.device | str | None = None,
          precision: Precision = Precision(),
          weights: str | os.PathLike | Pretrained | None = None,
          timeout: float = DEFAULT_TIMEOUT_S,
          layer_aux: bool | None = None, example: Any = None) -> tuple[ShardedModel, Params]:
    """Shard ``module`` over ``group`` or ``mesh``: returns ``(model, params)``, the static
    model and this rank's fp32 shards. The arguments: this module's docstring
    (``help(fz3.facade)``). **Collective**: every rank must call it (one small all-gather
    checks the ranks agree)."""
    check_not_wrapped(module)  # before an adapter is looked up for a wrapper's class
    paths, pre, post, call_layer, check_batch, outputs, assigned, layer_aux = _functions_given(
        module, layers, pre, post, call_layer, layer_aux)
    check_callable(module, paths, call_layer)  # children with no forward: before build
    read = None if weights is None else _checkpoint(weights, module)
    made = example is None and check_batch is not None  # a built-in adapter's, from the config
    if made:
        example = hf_example(_config(module))
    return build(module, paths, pre, post, call_layer, check_batch=check_batch, outputs=outputs,
                 between=between, assign={**assigned, **(assign or {})}, group=group,
                 mesh=mesh, device=device, precision=precision,
                 read=read, timeout=timeout, layer_aux=layer_aux, example=example,
                 example_made=made)


def _config(module: nn.Module) -> Any:
    """A Hugging Face model's config, through a PEFT wrapper too."""
    inner = module.get_base_model() if hasattr(module, "get_base_model") else module
    return inner.config


def _functions_given(module: nn.Module, layers, pre, post, call_layer, layer_aux):
    """``(paths, pre, post, call_layer, check_batch, outputs, assign, layer_aux)``: the
    user's, or the built-in adapter's when none of layers/pre/post is given (its outputs:
    ``{"logits": fn}``, the ``assign=`` it needs, which the user's adds to, and whether its
    layers return an aux output)."""
    check_batch, outputs, assign = None, {}, {}
    if layers is None and pre is None and post is None:
        adapter = adapter_for(module)
        layers, pre, post = adapter.layers, adapter.pre, adapter.post
        call_layer = call_layer or adapter.layer
        check_batch, outputs = adapter.check_batch, {"logits": adapter.logits}
        assign = adapter.assign
        if layer_aux is not None and bool(layer_aux) != adapter.layer_aux:
            raise ValueError(f"fz3.shard got layer_aux={layer_aux!r}, but the built-in adapter "
                             f"of {type(module).__name__} has layers that return "
                             f"{'(h, aux)' if adapter.layer_aux else 'h'} (its config decides: "
                             f"output_router_logits for an MoE model); leave layer_aux unset")
        layer_aux = adapter.layer_aux
    if layers is None or pre is None or post is None:
        raise TypeError("fz3.shard needs layers=, pre= and post= (or none of them, for a model "
                        "with a built-in adapter): layers='<path of the nn.ModuleList>', "
                        "pre(m, batch) -> h, post(m, h, batch) -> loss")
    paths = [layers] if isinstance(layers, str) else list(layers)
    return paths, pre, post, call_layer, check_batch, outputs, assign, bool(layer_aux)


def _checkpoint(weights, module: nn.Module) -> Reader:
    """Where the shards come from: each rank's slices of a checkpoint folder
    (``fz3/storage/pretrained.py``), the skeleton's meta buffers made real first. The folder
    is opened when ``build`` asks, after its own checks (as before the façade)."""

    def read(skeleton: nn.Module, device: torch.device):
        source = weights if isinstance(weights, Pretrained) else Pretrained(weights)
        names = checkpoint_names(module, source.files)
        pretrained.materialize_buffers(skeleton, source, names, device)
        return functools.partial(pretrained.piece, source, names)

    return read


def export(path: str | os.PathLike, model: ShardedModel, params: Params, *,
           format: Literal["safetensors", "torch"] | None = None,
           timeout: float = DEFAULT_TIMEOUT_S) -> ExportReport:
    """Write the consolidated weights (and persistent buffers) of ``model`` under ``path`` as a
    Hugging Face folder, one unit at a time (``fz3/storage/export.py``). A model sharded from a
    PEFT model is written as its base model with LoRA merged in, under the base model's names
    (``fz3/hf/peft_merge.py``; what cannot be merged is refused by name before any collective),
    so ``from_pretrained(path)`` loads the trained model; ``fz3.hf.export_peft`` writes the
    adapter alone.

    **Collective**: one all-gather per unit; every rank calls it. A rank of the sharding group
    that does not within ``timeout`` seconds makes the others raise
    ``fz3.CollectiveMismatchError`` naming it, before ``path`` is created."""
    return export_units(path, model, params, format=format, timeout=timeout,
                        rewrite=merge_for(model.skeleton))
