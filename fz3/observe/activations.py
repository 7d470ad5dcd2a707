"""Running each part of a model once, on zero parameters, to measure it: what its forward
leaves behind (the memory plan) and what it costs (the cost model's ``Workload``). Values do
not matter, shapes do. A measurement at plan time only: the executor itself uses no hooks."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..schedule.saveable import Saveable, save
from ..schedule.structure import Role
from ..sharding import compute
from ..sharding.model import ShardedModel
from ..step.traced import TracedLayers
from .live_bytes import LiveBytes

class LayerInputs(NamedTuple):
    """What a stack's first layer runs on at plan time, as traced programs take it."""

    row: torch.Tensor  # its (padded,) parameter row, zeros in the compute dtype
    frozen_row: torch.Tensor | None
    h: torch.Tensor  # detached
    extras: tuple  # the producing unit's extras as it made them (with gradient where they carry it)


# measure(part index, run, params, inputs, layer) -> run()'s output: ``run`` computes the part
# (one layer of a stack); ``params`` and ``inputs`` (h, none for pre) are the leaves it depends
# on; ``layer``: a stack's, what its layer runs on (None for other parts).
Measure = Callable[[int, Callable[[], Any], list[torch.Tensor], list[torch.Tensor],
                    LayerInputs | None], Any]


class PartActivations(NamedTuple):
    """Bytes, for one rank's batch."""

    # the h it runs on: a layer's (what recompute keeps), post's (alive through the loss op;
    # no unit keeps it), 0 for pre and between
    input: int
    graph: int  # what autograd keeps for one row: pre/between keep it, a layer keeps it when
    # saved and rebuilds it when recomputed, post holds it during the loss op
    forward: int = 0  # peak bytes a row's forward allocates without a graph (temporaries, output)
    train: int = 0  # peak bytes a row's forward with its graph and then its backward allocate
    kept: int = 0  # peak bytes a row's forward with its graph allocates (the graph included)


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
    # with layer_aux, each stack's aux as post takes it (its first layer's, repeated)
    layer_aux = []
    for i, part in enumerate(model.parts):
        fn = model.functions[i]
        inputs.append(0 if h is None else h.numel() * h.element_size())
        x = None if h is None else h.detach().requires_grad_()
        bound, leaves = tensors(i)
        if part.role is Role.PRE:
            h, extras = measure(i, lambda: compute.run_stage(fn, bound, (batch,), part.name),
                                leaves, [], None)
        elif part.role is Role.BETWEEN:
            h, extras = measure(i, lambda: compute.run_stage(fn, bound, (x, batch), part.name),
                                leaves, [x], None)
        elif part.role is Role.STACK and part.rows:
            ex = tuple(e.detach() if isinstance(e, torch.Tensor) else e for e in extras)
            measure(i, lambda: compute.run_layers(fn[:1], [bound], x, ex, part.path, part.first,
                                                  model.writes_input, model.layer_aux),
                    leaves, [x], LayerInputs(trained[i], frozen[i], h, extras))
            if model.layer_aux:
                with torch.no_grad():
                    a = compute.run_layers(fn[:1], [bound], h.detach(), ex, part.path,
                                           part.first, model.writes_input, True)[1]
                layer_aux.append(a.expand(part.rows, *a.shape[1:]))
        elif part.role is Role.POST:
            given = tuple(layer_aux) if model.layer_aux else None
            measure(i, lambda: compute.run_loss(fn, False, bound, x, batch, "post", given),
                    leaves, [x], None)
        h = None if h is None else h.detach()
    return inputs


def activation_sizes(model: ShardedModel, batch: Any, traced: TracedLayers | None = None,
                     saves: Saveable = save) -> tuple[PartActivations, ...]:
    """Per part, in order: the storages autograd saves running it, each counted once,
    parameters excluded; and the peak bytes its forward allocates, without a graph, with one,
    and with one followed by the backward, tracked by ``LiveBytes``. ``traced``: the engine
    runs the stacks' layers as its programs, so a layer it traces is measured by them instead
    (``traced_sizes``; ``saves``: the predicate its programs are cut by); one that falls back is
    measured through autograd, as it runs."""
    sizes: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)] * len(model.parts)

    def measure(i: int, run: Callable[[], Any], params: list[torch.Tensor],
                inputs: list[torch.Tensor], layer: LayerInputs | None) -> Any:
        if traced is not None and layer is not None:
            got = traced_sizes(traced, i, layer, saves)
            if got is not None:
                sizes[i] = got
                return None
        if layer is not None:  # a layer's first call learns whether it writes into its input
            with torch.no_grad():  # (``compute.guarded``: a copy then); not measured
                run()
        with torch.no_grad(), LiveBytes() as live:
            run()
        forward = live.peak
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
            kept = live.mark()
            h = out[0] if isinstance(out, tuple) else out
            wrt = [t for t in (*params, *inputs) if t.requires_grad]
            if h.requires_grad and wrt:
                torch.autograd.grad(h, wrt, torch.ones_like(h), allow_unused=True)
        sizes[i] = (forward, sum(seen.values()), kept, live.peak)
        return out

    inputs = walk_parts(model, batch, measure)
    return tuple(PartActivations(inputs[i] if p.role in (Role.STACK, Role.POST) else 0,
                                 graph, forward, train, kept)
                 for i, (p, (forward, graph, kept, train)) in enumerate(zip(model.parts, sizes)))


def traced_sizes(traced: TracedLayers, i: int, layer: LayerInputs,
                 saves: Saveable = save) -> tuple[int, int, int, int] | None:
    """A traced layer's ``(forward, graph, kept, train)`` bytes (``PartActivations``), or None
    if it runs through autograd: ``graph`` is its residuals' storages, each counted once, the
    parameter rows' excluded, read from the fake tensors of its trace (nothing computed);
    ``forward``, ``kept`` and ``train`` the peaks of its inference program, of its forward
    program, and of that followed by its backward, run on zeros. The programs are the step's
    own: traced here, they are kept in the model (``ShardedModel.traces``) for every step
    function on it."""
    positions = compute.differentiable(layer.extras)
    extras = traced.extras(compute.detach_extras(layer.extras, positions, grad=False), positions)
    # every layer of the part traced (as the first step does; kept for it): if one cannot
    # be, the part runs through autograd and is measured so
    got = traced.layers(i, 0, traced.model.parts[i].rows, layer.h, extras, saves)
    if got is None:
        return None
    programs = got.programs[0]
    params = [layer.row] if layer.frozen_row is None else [layer.row, layer.frozen_row]
    inputs = [*params, layer.h, *extras.tensors, *got.buffers[0]]
    with torch.no_grad(), LiveBytes() as live:
        programs.inference(*inputs)
    forward = live.peak
    with torch.no_grad(), LiveBytes() as live:
        outs = programs.forward(*inputs)
        out, residuals = outs[0], list(outs[programs.outputs:])
        del outs
        kept = live.mark()
        # the executor holds the cotangent (the step's, for its frame) through the backward,
        # and hands the residuals over in the list alone (freed inside after their last use)
        g = torch.ones(out.shape, dtype=out.dtype, device=out.device)  # as traced: contiguous
        seeds = [g] if programs.aux is None else [g, torch.ones(programs.aux[0],
                                                                dtype=programs.aux[1],
                                                                device=g.device)]
        box = [*params, *residuals, *seeds]
        del residuals
        programs.backward(box)
    return (forward, residual_bytes(programs.graphs[0], len(params), programs.outputs), kept,
            live.peak)


def residual_bytes(forward: torch.fx.Graph, params: int, outputs: int = 1) -> int:
    """The bytes of a forward program's residuals (its outputs after h, and after its aux
    output if ``outputs`` is 2), from the trace's fake values: each storage once, the first
    ``params`` inputs' (parameter rows) excluded."""
    places = [n for n in forward.nodes if n.op == "placeholder"]
    rows = {StorageWeakRef(n.meta["val"].untyped_storage()) for n in places[:params]}
    out = next(n for n in forward.nodes if n.op == "output")
    seen: dict[StorageWeakRef, int] = {}
    for node in out.args[0][outputs:]:
        storage = node.meta["val"].untyped_storage()
        key = StorageWeakRef(storage)
        if key not in rows:
            seen[key] = storage.nbytes()
    return sum(seen.values())
