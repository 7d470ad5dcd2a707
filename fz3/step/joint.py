"""A layer's pure function, traced once into plain programs: forward and backward (and from
them inference, and the two joined for a recompute).

The autograd engine is the largest host cost of a per-layer executor: every layer pays one
``torch.autograd.grad`` call and the engine's bookkeeping per op (``benchmarks/host_floor.py``).
A layer of a stack is a pure function ``f(row, frozen_row, h, *extras) -> h``, so its
derivative can be traced ahead of time instead: ``make_fx`` of ``f`` followed by
``torch.autograd.grad`` records the forward and the backward ATen ops of one call in a single
joint graph, with fake tensors (a tensor's value read on the host, a data-dependent branch,
fails the trace; nothing is computed, no RNG is drawn). ``fz3.step.partition`` cuts it into a
forward and a backward program by dataflow (a layer keeps at most what autograd saves).

Both halves become Python functions (``fz3.step.codegen``), or go to inductor
(``fz3.step.traced``).
They compute the same ATen ops with the same derivative formulas as eager autograd, in the
same order, so results are bitwise equal to it (``tests/test_traced.py``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from ..sharding.placement import quiet_fake_tensor_log
from . import fake_kernels
from .codegen import (TraceError, codegen, constant_factories, copy_graph, fast_ops,
                      one_call_flatten, one_call_views)
from ..schedule.saveable import Saveable, save
from .into import BackwardInto
from .partition import joined, partition, written, written_args

Layer = Callable[..., torch.Tensor]  # (row, frozen_row | None, h, *extras) -> h | (h, aux)


class Programs(NamedTuple):
    """One layer's traced halves. ``forward(*inputs) -> (h, *residuals)``;
    ``backward([row, frozen_row, *residuals, g]) -> (grad_row, grad_h, *grad_extras)`` (the
    differentiable extras, in order; one list, emptied by the call); ``inference(*inputs) ->
    (h,)`` for forwards without gradient. A layer with an aux output (``aux``: its shape and
    dtype) returns ``(h, aux, *residuals)`` and ``(h, aux)``, and its backward takes ``g,
    g_aux`` last. ``inputs`` are ``(row, frozen_row, h, *tensor_extras)``, ``frozen_row``
    left out when the layer has none. Each takes the keyword ``made``: where its rows' views
    are kept (``fz3.step.views.RowViews``; None: made each call). The graphs are kept for
    inductor (and identify the programs: compilations are keyed by them); ``source`` is the
    Python programs' code, for reading (constants appear by name, not value).
    ``recompute([*inputs, g]) -> what backward returns`` (``g, g_aux`` last with an aux
    output; one list, emptied): the forward and the backward as one program
    (``partition.joined``), for a recompute."""

    forward: Callable[..., tuple]
    backward: Callable[..., tuple]
    inference: Callable[..., torch.Tensor]
    graphs: tuple  # forward, backward, inference, recompute (None: cut by another predicate)
    source: str
    aux: tuple | None = None  # (shape, dtype) of the layer's aux output; None: it has none
    # ``backward`` writing its flat gradient into the unit's gradient memory
    # (``fz3.step.memory``), made at its first call; None: it has no such form (inductor's
    # programs, a gradient not made by one flatten)
    backward_into: BackwardInto | None = None
    recompute: Callable[..., tuple] | None = None  # None: forward, then backward
    recompute_into: BackwardInto | None = None  # ``backward_into``'s, for ``recompute``
    # whether the predicate it was cut by kept any op it was asked about (``partition``)
    kept_any: bool = True

    @property
    def outputs(self) -> int:
        """The forward's outputs before its residuals: h, and the aux output if any."""
        return 1 if self.aux is None else 2


class Joint(NamedTuple):
    """A layer's joint graph (forward, then backward), before it is split into programs."""

    graph: fx.Graph
    # the graph as Python code, every op and argument value printed: layers whose joint
    # graphs read alike share programs
    code: str
    first: int  # inputs[first] is h; before it, the parameter rows
    grads: int  # gradients it returns: the row's, h's, each differentiable extra's
    aux: tuple | None = None  # the aux output's (shape, dtype), or None (``Programs.aux``)


def trace(layer: Layer, inputs: Sequence[torch.Tensor], frozen: bool,
          differentiable: Sequence[int], aux: bool = False) -> Programs:
    """Trace ``layer`` on ``inputs`` = ``(row, [frozen_row,] h, *tensor_extras)`` into its
    programs. ``differentiable``: positions in ``tensor_extras`` whose gradient the backward
    returns; ``aux``: the layer returns ``(h, aux)``. Raises ``TraceError`` naming why a layer
    cannot be traced."""
    return programs(joint_trace(layer, inputs, frozen, differentiable, aux))


def joint_trace(layer: Layer, inputs: Sequence[torch.Tensor], frozen: bool,
                differentiable: Sequence[int], aux: bool = False) -> Joint:
    """``trace``'s first half: the joint graph of ``layer`` on ``inputs`` (with ``aux``: its
    outputs h and aux, its cotangents g and g_aux)."""
    first = 2 if frozen else 1  # inputs[first] is h
    n = len(inputs)
    wrt = [0, first, *(first + 1 + j for j in differentiable)]

    def call(*xs: torch.Tensor) -> tuple:
        out = layer(xs[0], xs[1] if frozen else None, *xs[first:])
        if not aux:
            if not isinstance(out, torch.Tensor):
                raise TraceError(f"it returned {type(out).__name__}, not a tensor")
            return (out,)
        if not (isinstance(out, tuple) and len(out) == 2
                and all(isinstance(o, torch.Tensor) for o in out)):
            raise TraceError(f"it returned {type(out).__name__}, not (h, aux)")
        return out

    def joint(*xs: torch.Tensor) -> tuple:
        # torch.autograd.grad, not torch.func.vjp: the same derivative formulas as eager
        # autograd (functorch decomposes some backwards, silu's for one, into other ops)
        ins = [x.detach().requires_grad_() if i in wrt else x for i, x in enumerate(xs[:n])]
        with torch.enable_grad():
            # h through a copy: a layer that writes into its input (``h.mul_(0.5)``) writes
            # into the copy, as into the previous layer's output in plain PyTorch; a copy
            # nothing writes into is folded away after the trace (``_fold_input_copy``)
            outs = call(*ins[:first], ins[first].clone(), *ins[first + 1:])
            # an aux computed from nothing differentiable (counts) has no gradient path
            seeded = [(o, c) for o, c in zip(outs, xs[n:]) if o.requires_grad or o is outs[0]]
            grads = torch.autograd.grad([o for o, _ in seeded], [ins[i] for i in wrt],
                                        [c for _, c in seeded], allow_unused=True)
        return (*(o.detach() for o in outs), *(torch.zeros_like(ins[i]) if g is None else g
                                              for i, g in zip(wrt, grads)))

    plain = [t.detach() for t in inputs]
    try:
        with quiet_fake_tensor_log():
            shape = _aux_shape(call, plain) if aux else None
            # g contiguous, as a layer's backward hands it on (``Layers.g_strides``)
            cotangents = [torch.empty_like(plain[first], memory_format=torch.contiguous_format)]
            if shape is not None:
                cotangents.append(torch.empty(shape[0], dtype=shape[1], device=plain[first].device))
            joint_gm = make_fx(joint, tracing_mode="fake",  # (fake kernels' refusals met)
                               decomposition_table=fake_kernels.TABLE)(*plain, *cotangents)
    except TraceError:
        raise
    except Exception as e:  # noqa: BLE001 - tracing fails in many ways; each means: fall back
        first_line = str(e).splitlines()[0][:300] if str(e) else ""
        raise TraceError(f"{type(e).__name__}: {first_line}") from e
    _fold_input_copy(joint_gm.graph, first)
    _refuse_input_mutation(joint_gm.graph)
    _refuse_tensor_constants(joint_gm.graph)
    return Joint(joint_gm.graph, joint_gm.code, first, len(wrt), shape)


def _aux_shape(call: Callable[..., tuple], plain: list[torch.Tensor]) -> tuple:
    """The aux output's ``(shape, dtype)``, from a trace of the layer on fake tensors (its
    cotangent is an input of the joint trace), with the joint trace's ``fake_kernels``."""
    with torch.no_grad():
        graph = make_fx(lambda *xs: call(*xs)[1], tracing_mode="fake",
                        decomposition_table=fake_kernels.TABLE)(*plain).graph
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    aux = (out[0] if isinstance(out, (list, tuple)) else out).meta["val"]
    if not aux.is_floating_point():
        raise TraceError(f"its aux output is {aux.dtype}, not a floating tensor")
    return tuple(aux.shape), aux.dtype


def programs(joint: Joint, saves: Saveable = save) -> Programs:
    """``trace``'s second half: a joint graph split into programs (the graph is changed).
    ``saves``: which forward ops' outputs the forward keeps (``fz3.step.partition``; ``save``:
    what autograd would)."""
    first, n = joint.first, 1 if joint.aux is None else 2  # (``Programs.outputs``)
    _fold_transposes(joint.graph)
    fwd, bwd, kept_any = partition(joint.graph, params=range(first), grads=joint.grads,
                                   saves=saves, outputs=n)
    # Forwards without gradient run the forward's ops, residuals not returned: the same
    # kernels as the recompute that follows them (eager may pick others without grad mode);
    # programs cut by another predicate never recompute (they keep residuals): no joined one
    rec = joined(fwd, bwd, first, n) if saves is save else None
    graphs = (fwd, bwd, _forward_only(fwd, n), rec)  # as traced
    slow_f, slow_b = fast_ops(fwd), fast_ops(bwd, boxed=True)
    # the joined nodes are the halves', arguments and all: each half's ``_op`` calls are its
    slow_r = None if slow_f is None or slow_b is None else slow_f | slow_b
    # for Python, a copy with the parameter views made and the gradient flattened in one
    # call each, and constant zeros made once (a dozen ops fewer per program; nothing
    # inductor could compile)
    fwd, bwd, inf, rec = (None if g is None else copy_graph(g) for g in graphs)
    made = [g for g in (fwd, bwd, inf, rec) if g is not None]
    shared: dict = {}  # each row's views, made once for the layer's programs
    for g in made:
        one_call_views(g, params=first, shared=shared)
        if g is bwd or g is rec:  # their flat gradients
            one_call_flatten(g)
    for g in made:
        constant_factories(g)
    forward, s1 = codegen(fwd, "forward", slow=slow_f)
    backward, s2 = codegen(bwd, "backward", boxed=True, slow=slow_b)
    infer, s3 = codegen(inf, "inference", slow=slow_f)
    recompute, s4, into = None, "", None
    if rec is not None:
        recompute, s4 = codegen(rec, "recompute", boxed=True, slow=slow_r)
        into = BackwardInto.of(rec, slow_r)
    return Programs(forward, backward, infer, graphs, s1 + s2 + s3 + s4, joint.aux,
                    BackwardInto.of(bwd, slow_b), recompute, into, kept_any)


def _fold_input_copy(graph: fx.Graph, first: int) -> None:
    """The trace's copy of h (``joint_trace``) stays only if an op writes into it or a view of
    it; otherwise its readers read h (the graph's code, printed before, still names it:
    layers alike print alike either way)."""
    h = [n for n in graph.nodes if n.op == "placeholder"][first]
    seen = [h]
    for node in graph.nodes:
        if node.target is torch.ops.aten.detach.default and node.args[0] in seen:
            seen.append(node)
        elif node.target is torch.ops.aten.clone.default and node.args[0] in seen:
            if not written(node):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
            return


def _refuse_input_mutation(graph: fx.Graph) -> None:
    """An op writing into one of the program's inputs (an extra, ``count.add_(1)``, or a
    parameter row; h is copied first when written, ``_fold_input_copy``) would write into
    fz3's buffers or a pre unit's outputs at every replay: such a layer runs through
    autograd."""
    inputs = {n for n in graph.nodes if n.op == "placeholder"}
    for node in graph.nodes:
        if any(value in inputs for value in written_args(node)):
            raise TraceError(f"it writes into its input in place ({node.target})")


def _refuse_tensor_constants(graph: fx.Graph) -> None:
    """A tensor made from Python values inside the layer (``torch.tensor(2.0)``, a number
    written through a view, ``m[0] = 3.0``) is a constant of the trace whose value its code
    does not show: such a layer runs through autograd."""
    for node in graph.nodes:
        if node.op == "get_attr":
            raise TraceError("it makes a tensor from Python values (torch.tensor(...), or a "
                             "number written through a view such as m[0] = 3.0): make it from "
                             "an input instead (torch.full_like, h.new_tensor), or pass it as "
                             "an extra")


def _fold_transposes(graph: fx.Graph) -> None:
    """``t(t(x))`` is ``x`` (autograd's formula for ``mm`` transposes a transposed weight), and
    ``detach(x)`` is ``x`` for programs that run without autograd (the trace detaches the
    inputs it differentiates)."""
    t, detach = torch.ops.aten.t.default, torch.ops.aten.detach.default
    for node in list(graph.nodes):
        if node.target is detach:
            node.replace_all_uses_with(node.args[0])
        elif node.target is t and isinstance(node.args[0], fx.Node) and node.args[0].target is t:
            node.replace_all_uses_with(node.args[0].args[0])
    graph.eliminate_dead_code()


def _forward_only(forward: fx.Graph, outputs: int = 1) -> fx.Graph:
    """``forward`` returning ``(h,)`` (or ``(h, aux)``) only: what no residual needs is not
    computed, every value is dropped after its last use."""
    graph = copy_graph(forward)
    out = next(n for n in graph.nodes if n.op == "output")
    out.args = (tuple(out.args[0][:outputs]),)
    graph.eliminate_dead_code()
    return graph
