"""A layer's pure function, traced once into two plain programs: forward and backward.

The autograd engine is the largest host cost of a per-layer executor: every layer pays one
``torch.autograd.grad`` call and the engine's bookkeeping per op (``benchmarks/host_floor.py``).
A layer of a stack is a pure function ``f(row, frozen_row, h, *extras) -> h``, so its
derivative can be traced ahead of time instead: ``make_fx`` of ``f`` followed by
``torch.autograd.grad`` records the forward and the backward ATen ops of one call in a single
joint graph, with fake tensors (a tensor's value read on the host, a data-dependent branch,
fails the trace; nothing is computed, no RNG is drawn). The graph is cut by dataflow:

- forward: the ancestors of the layer's output ``h``, with any op that writes into one of
  them (or a view of one) or draws random numbers, as eager autograd runs them;
- backward: the rest: what depends on the cotangent ``g``, and the parts of derivative
  formulas that need no cotangent (``pow``'s ``2 * x``, ``rsqrt``'s ``-0.5 * y**3``), which
  autograd too computes in backward from what it saved; also the views of the parameter rows
  it reads (recomputed from the re-gathered row, so no residual aliases a gathered buffer
  that ``free`` releases), and constants only it uses (a padding's zero gradient).

The forward nodes the backward reads are the residuals, kept between the two as a tuple of
tensors: at most what autograd saves for the same layer (``tests/test_traced_memory.py``;
cutting at "depends on ``g``" instead, as before, kept each RMSNorm's cotangent-free factors
too: 10-13% more per Llama-family layer).

Both halves become Python functions (``fz3.step.codegen``), or go to inductor
(``fz3.step.traced``).
They compute the same ATen ops with the same derivative formulas as eager autograd, in the
same order, so results are bitwise equal to it (``tests/test_traced.py``).
"""

from __future__ import annotations

import operator
from typing import Callable, NamedTuple, Sequence

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from .codegen import (CONSTANT_FACTORIES, TraceError, codegen, constant_factories, fast_ops,
                      one_call_flatten, one_call_views)

Layer = Callable[..., torch.Tensor]  # (row, frozen_row | None, h, *extras) -> h


class Programs(NamedTuple):
    """One layer's traced halves. ``forward(*inputs) -> (h, *residuals)``;
    ``backward([row, frozen_row, *residuals, g]) -> (grad_row, grad_h, *grad_extras)`` (the
    differentiable extras, in order; one list, emptied by the call); ``inference(*inputs) ->
    (h,)`` for forwards without gradient. ``inputs`` are ``(row, frozen_row, h,
    *tensor_extras)``, ``frozen_row`` left out when the layer has none. The graphs are kept
    for inductor (and identify the programs: compilations are keyed by them); ``source`` is
    the Python programs' code, for reading (constants appear by name, not value)."""

    forward: Callable[..., tuple]
    backward: Callable[..., tuple]
    inference: Callable[..., torch.Tensor]
    graphs: tuple[fx.Graph, fx.Graph, fx.Graph]
    source: str
    # a residual may share storage with a parameter row (then the executor keeps the row's
    # storage object across free and re-gather, as for an autograd graph)
    aliases_params: bool = True


class Joint(NamedTuple):
    """A layer's joint graph (forward, then backward), before it is split into programs."""

    graph: fx.Graph
    # the graph as Python code, every op and argument value printed: layers whose joint
    # graphs read alike share programs
    code: str
    first: int  # inputs[first] is h; before it, the parameter rows
    grads: int  # gradients it returns: the row's, h's, each differentiable extra's


def trace(layer: Layer, inputs: Sequence[torch.Tensor], frozen: bool,
          differentiable: Sequence[int]) -> Programs:
    """Trace ``layer`` on ``inputs`` = ``(row, [frozen_row,] h, *tensor_extras)`` into its
    programs. ``differentiable``: positions in ``tensor_extras`` whose gradient the backward
    returns. Raises ``TraceError`` naming why a layer cannot be traced."""
    return programs(joint_trace(layer, inputs, frozen, differentiable))


def joint_trace(layer: Layer, inputs: Sequence[torch.Tensor], frozen: bool,
                differentiable: Sequence[int]) -> Joint:
    """``trace``'s first half: the joint graph of ``layer`` on ``inputs``."""
    first = 2 if frozen else 1  # inputs[first] is h
    n = len(inputs)
    wrt = [0, first, *(first + 1 + j for j in differentiable)]

    def call(*xs: torch.Tensor) -> torch.Tensor:
        out = layer(xs[0], xs[1] if frozen else None, *xs[first:])
        if not isinstance(out, torch.Tensor):
            raise TraceError(f"it returned {type(out).__name__}, not a tensor")
        return out

    def joint(*xs: torch.Tensor) -> tuple:
        # torch.autograd.grad, not torch.func.vjp: the same derivative formulas as eager
        # autograd (functorch decomposes some backwards, silu's for one, into other ops)
        ins = [x.detach().requires_grad_() if i in wrt else x for i, x in enumerate(xs[:n])]
        with torch.enable_grad():
            out = call(*ins)
            grads = torch.autograd.grad(out, [ins[i] for i in wrt], xs[n], allow_unused=True)
        return (out.detach(), *(torch.zeros_like(ins[i]) if g is None else g
                                for i, g in zip(wrt, grads)))

    plain = [t.detach() for t in inputs]
    try:
        joint_gm = make_fx(joint, tracing_mode="fake")(*plain, torch.empty_like(plain[first]))
    except TraceError:
        raise
    except Exception as e:  # noqa: BLE001 - tracing fails in many ways; each means: fall back
        first_line = str(e).splitlines()[0][:300] if str(e) else ""
        raise TraceError(f"{type(e).__name__}: {first_line}") from e
    _refuse_input_mutation(joint_gm.graph)
    _refuse_tensor_constants(joint_gm.graph)
    return Joint(joint_gm.graph, joint_gm.code, first, len(wrt))


def programs(joint: Joint) -> Programs:
    """``trace``'s second half: a joint graph split into programs (the graph is changed)."""
    first = joint.first
    _fold_transposes(joint.graph)
    fwd, bwd = partition(joint.graph, params=range(first), grads=joint.grads)
    aliases = _residuals_alias_params(fwd, params=first)
    # Forwards without gradient run the forward's ops, residuals not returned: the same
    # kernels as the recompute that follows them (eager may pick others without grad mode)
    graphs = (fwd, bwd, _forward_only(fwd))  # for inductor, as traced
    slow_f, slow_b = fast_ops(fwd), fast_ops(bwd, boxed=True)
    # for Python, a copy with the parameter views made and the gradient flattened in one
    # call each, and constant zeros made once (a dozen ops fewer per program; nothing
    # inductor could compile)
    fwd, bwd, inf = (_copy(g) for g in graphs)
    for g in (fwd, bwd, inf):
        one_call_views(g, params=first)
    one_call_flatten(bwd)
    for g in (fwd, bwd, inf):
        constant_factories(g)
    forward, s1 = codegen(fwd, "forward", slow=slow_f)
    backward, s2 = codegen(bwd, "backward", boxed=True, slow=slow_b)
    infer, s3 = codegen(inf, "inference", slow=slow_f)
    return Programs(forward, backward, infer, graphs, s1 + s2 + s3, aliases)


def partition(joint: fx.Graph, params: range, grads: int) -> tuple[fx.Graph, fx.Graph]:
    """Split a joint graph (inputs ``(*inputs, g)``, outputs ``(out, *grads)``) into forward
    ``(*inputs) -> (out, *residuals)`` and backward ``(*param inputs, *residuals, g) -> grads``.
    ``params``: the positions of the parameter rows, whose views the backward recomputes."""
    places = [n for n in joint.nodes if n.op == "placeholder"]
    out_node = next(n for n in joint.nodes if n.op == "output")
    out, *grad_nodes = out_node.args[0]
    assert len(grad_nodes) == grads
    rows = {places[i] for i in params}
    forward_side = _forward_side(joint, out, places[-1])
    backward_side = {n for n in joint.nodes if n.op == "call_function" and n not in forward_side}
    backward_side.add(places[-1])
    for node in joint.nodes:
        ins = node.all_input_nodes
        if (node.op == "call_function" and ins and all(a in rows for a in ins)
                and _is_view(node)):
            rows.add(node)  # a view of a parameter row: recomputed where it is needed
    # a constant (the zeros of a padding's gradient) is made again where needed, not kept as a
    # residual, unless an op writes into it: that write happened in the forward
    rows.update(n for n in joint.nodes if n.op == "call_function" and not n.all_input_nodes
                and n.target in CONSTANT_FACTORIES and not _written(n))
    # the backward recomputes what depends on g, the row views and those constants;
    # everything else it reads (forward values, h, extras) is a residual
    computed = backward_side | rows
    needed = _ancestors(grad_nodes, stop=lambda m: m not in computed)
    residuals = [m for m in joint.nodes if m in needed and m not in computed]

    fwd, env = fx.Graph(), {}
    for p in places[:-1]:
        env[p] = _placeholder(fwd, p.name, p)
    for node in joint.nodes:
        if node.op == "call_function" and node in forward_side:
            env[node] = fwd.node_copy(node, env.__getitem__)
    fwd.output((env[out], *(env[m] for m in residuals)))
    fwd.eliminate_dead_code()

    bwd, benv = fx.Graph(), {}
    for i in params:
        benv[places[i]] = _placeholder(bwd, places[i].name, places[i])
    for m in residuals:
        benv[m] = _placeholder(bwd, "saved_" + m.name, m)
    benv[places[-1]] = _placeholder(bwd, "g", places[-1])
    for node in joint.nodes:
        if node.op == "call_function" and node in needed and node not in benv:
            benv[node] = bwd.node_copy(node, benv.__getitem__)
    bwd.output(tuple(benv[m] for m in grad_nodes))
    bwd.eliminate_dead_code()
    return fwd, bwd


def _forward_side(joint: fx.Graph, out: fx.Node, g: fx.Node) -> set[fx.Node]:
    """What the forward computes: the ancestors of the layer's output, with every op that
    writes into one of them or draws random numbers (where eager autograd runs them, in the
    forward), and their ancestors. The rest of the joint graph is the backward's, so a part
    of a derivative formula that needs no cotangent (``pow``'s ``2 * x``) is computed there
    from what the forward keeps, as autograd does, instead of being kept itself."""
    side = _ancestors([out], stop=lambda m: False)
    depends_on_g = {g}
    for node in joint.nodes:
        if any(a in depends_on_g for a in node.all_input_nodes):
            depends_on_g.add(node)
    grew = True
    while grew:
        grew = False
        for node in joint.nodes:
            if node in side or node in depends_on_g or node.op != "call_function":
                continue
            if _writes_into(node, side) or _draws_random(node):
                side |= _ancestors([node], stop=lambda m: False)
                grew = True
    # an output of a forward op with several (layer norm's mean and rstd): picked out where
    # the op runs, so a residual is always a tensor, never the op's whole tuple
    side |= {n for n in joint.nodes if n.target is operator.getitem and n.args[0] in side
             and n not in depends_on_g}
    return side


def _writes_into(node: fx.Node, tensors: set[fx.Node]) -> bool:
    """Whether ``node`` writes into one of ``tensors`` or a view of one."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    for i, arg in enumerate(node.target._schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if not (isinstance(value, fx.Node) and arg.alias_info is not None
                and arg.alias_info.is_write):
            continue
        while value not in tensors and _is_view(value) and value.args:
            value = value.args[0]  # the tensor it is a view of
        if value in tensors:
            return True
    return False


def _draws_random(node: fx.Node) -> bool:
    return (isinstance(node.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in node.target.tags)


def _residuals_alias_params(forward: fx.Graph, params: int) -> bool:
    """Whether a residual of ``forward`` may share storage with a parameter row (its fake
    values know their storages; unknown counts as yes)."""
    def storage(node: fx.Node):
        val = node.meta.get("val")
        return val.untyped_storage() if isinstance(val, torch.Tensor) else None

    try:
        rows = [storage(n) for n in forward.nodes if n.op == "placeholder"][:params]
        out = next(n for n in forward.nodes if n.op == "output")
        saved = [storage(n) for n in out.args[0][1:]]
    except Exception:  # noqa: BLE001 - no storage information: assume the worst
        return True
    if any(r is None for r in rows) or any(t is None for t in saved):
        return True
    return any(t is r for t in saved for r in rows)


def _placeholder(graph: fx.Graph, name: str, like: fx.Node) -> fx.Node:
    """An input standing for ``like``, with its recorded (fake) value (``fast_ops`` traces
    with it)."""
    node = graph.placeholder(name)
    node.meta["val"] = like.meta.get("val")
    return node


def _ancestors(roots: Sequence[fx.Node], stop: Callable[[fx.Node], bool]) -> set[fx.Node]:
    """``roots`` and the nodes they read, not looking past a node for which ``stop`` holds
    (a residual: it is read, not recomputed)."""
    seen: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        if not stop(m):
            todo.extend(m.all_input_nodes)
    return seen


def _is_view(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _written(node: fx.Node) -> bool:
    """Whether an op writes into ``node``'s tensor or a view of it."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if isinstance(user.target, torch._ops.OpOverload):
                for i, arg in enumerate(user.target._schema.arguments):
                    value = (user.args[i] if i < len(user.args) else
                             user.kwargs.get(arg.name))
                    if value is n and arg.alias_info is not None and arg.alias_info.is_write:
                        return True
            if _is_view(user):
                todo.append(user)
    return False


def _refuse_input_mutation(graph: fx.Graph) -> None:
    """An op writing into one of the layer's inputs (``h.add_(...)``) would write into fz3's
    buffers or the previous layer's output: such a layer runs through autograd."""
    inputs = {n for n in graph.nodes if n.op == "placeholder"}
    for node in graph.nodes:
        if not isinstance(node.target, torch._ops.OpOverload):
            continue
        for arg, value in zip(node.target._schema.arguments, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write and value in inputs:
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


def _forward_only(forward: fx.Graph) -> fx.Graph:
    """``forward`` returning ``(h,)`` only: what no residual needs is not computed, every
    value is dropped after its last use."""
    graph = _copy(forward)
    out = next(n for n in graph.nodes if n.op == "output")
    out.args = ((out.args[0][0],),)
    graph.eliminate_dead_code()
    return graph


def _copy(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    new.output(new.graph_copy(graph, {}))
    return new
