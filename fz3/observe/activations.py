"""Running each part of a model once, on zero parameters, to measure it: what its forward
leaves behind (the memory plan) and what it costs (the cost model's ``Workload``). Values do
not matter, shapes do. A measurement at plan time only: the executor itself uses no hooks."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from ..schedule.structure import Role
from ..sharding import compute
from ..sharding.model import ShardedModel
from .live_bytes import LiveBytes

# measure(part index, run, params, inputs) -> run()'s output: ``run`` computes the part (one
# layer of a stack); ``params`` and ``inputs`` (h, none for pre) are the leaves it depends on.
Measure = Callable[[int, Callable[[], Any], list[torch.Tensor], list[torch.Tensor]], Any]


class PartActivations(NamedTuple):
    """Bytes, for one rank's batch."""

    input: int  # one row's input h (what recompute keeps for a layer)
    graph: int  # what autograd keeps for one row: pre/between keep it, a layer keeps it when
    # saved and rebuilds it when recomputed, post holds it during the loss op
    forward: int = 0  # peak bytes a row's forward allocates without a graph (temporaries, output)
    train: int = 0  # peak bytes a row's forward with its graph and then its backward allocate


def walk_parts(model: ShardedModel, batch: Any, measure: Measure) -> list[int]:
    """Run pre, one layer of each stack, the between functions and post, in order, each
    through ``measure``; return the bytes of h entering each part."""
    dev = model.device
    trained = [compute.leaf(torch.zeros(p.layout.padded, dtype=model.precision.compute, device=dev))
               for p in model.parts]
    frozen = [None if p.frozen is None
              else torch.zeros(p.frozen.padded, dtype=model.precision.frozen, device=dev)
              for p in model.parts]

    def tensors(i: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A function's tensors (``layouts``' order), and the leaves among them."""
        out, leaves = [], []
        for v in (i, *model.parts[i].reads):
            part = model.parts[v]
            out += part.layout.views(trained[v]) + ([] if part.frozen is None
                                                    else part.frozen.views(frozen[v]))
            leaves.append(trained[v])
        return out, leaves

    inputs: list[int] = []
    h, extras = None, ()
    for i, part in enumerate(model.parts):
        fn = model.functions[i]
        inputs.append(0 if h is None else h.numel() * h.element_size())
        x = None if h is None else h.detach().requires_grad_()
        bound, leaves = tensors(i)
        if part.role is Role.PRE:
            h, extras = measure(i, lambda: compute.run_stage(fn, bound, (batch,), part.name),
                                leaves, [])
        elif part.role is Role.BETWEEN:
            h, extras = measure(i, lambda: compute.run_stage(fn, bound, (x, batch), part.name),
                                leaves, [x])
        elif part.role is Role.STACK and part.rows:
            ex = tuple(e.detach() if isinstance(e, torch.Tensor) else e for e in extras)
            measure(i, lambda: compute.run_layers(fn[:1], [bound], x, ex, part.path, part.first),
                    leaves, [x])
        elif part.role is Role.POST:
            measure(i, lambda: compute.run_loss(fn, False, bound, x, batch, "post"), leaves, [x])
        h = None if h is None else h.detach()
    return inputs


def activation_sizes(model: ShardedModel, batch: Any) -> tuple[PartActivations, ...]:
    """Per part, in order: the storages autograd saves running it, each counted once,
    parameters excluded; and the peak bytes its forward allocates, without a graph and with
    one followed by the backward, tracked by ``LiveBytes``."""
    graphs, forwards, trains = ([0] * len(model.parts), [0] * len(model.parts),
                                [0] * len(model.parts))

    def measure(i: int, run: Callable[[], Any], params: list[torch.Tensor],
                inputs: list[torch.Tensor]) -> Any:
        with torch.no_grad(), LiveBytes() as live:
            run()
        forwards[i] = live.peak
        exclude = {t.untyped_storage().data_ptr() for t in params}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            if s.data_ptr() not in exclude:
                seen[s.data_ptr()] = s.nbytes()
            return t

        with LiveBytes() as live:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = run()
            h = out[0] if isinstance(out, tuple) else out
            wrt = [t for t in (*params, *inputs) if t.requires_grad]
            if h.requires_grad and wrt:
                torch.autograd.grad(h, wrt, torch.ones_like(h), allow_unused=True)
        graphs[i], trains[i] = sum(seen.values()), live.peak
        return out

    inputs = walk_parts(model, batch, measure)
    return tuple(PartActivations(inputs[i] if p.role is Role.STACK else 0, graphs[i], forwards[i],
                                 trains[i])
                 for i, p in enumerate(model.parts))
