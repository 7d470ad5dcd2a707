"""Where a layer's joint graph is cut into a forward and a backward program: by dataflow.

- forward: the ancestors of the layer's output ``h`` (and of its aux output), with any op
  that writes into one of them (or a view of one) or draws random numbers, as eager autograd
  runs them, every op the trace ran before the forward's last such write (autograd's copies
  of an in-place op's input), and the ``getitem``s picking the outputs of those ops;
- backward: the rest: what depends on the cotangent ``g``, and the parts of derivative
  formulas that need no cotangent (``pow``'s ``2 * x``, ``rsqrt``'s ``-0.5 * y**3``), which
  autograd too computes in backward from what it saved; also the views of the parameter rows
  it reads (recomputed from the re-gathered row, so no residual aliases a gathered buffer
  that ``free`` releases), and constants only it uses (a padding's zero gradient).

The forward nodes the backward reads are the residuals, kept between the two as a tuple of
tensors: at most what autograd saves for the same layer (``tests/test_traced_memory.py``;
cutting at "depends on ``g``" instead, as before, kept each RMSNorm's cotangent-free factors
too: 10-13% more per Llama-family layer).
"""

from __future__ import annotations

import operator
from typing import Callable, Sequence

import torch
from torch import fx

from ..schedule.saveable import Saveable, keeps, save
from .codegen import CONSTANT_FACTORIES


def partition(joint: fx.Graph, params: range, grads: int, saves: Saveable = save,
              outputs: int = 1) -> tuple[fx.Graph, fx.Graph, bool]:
    """Split a joint graph (inputs ``(*inputs, *cotangents)``, outputs ``(*outs, *grads)``,
    ``outputs`` of each: h, and a layer's aux output) into forward ``(*inputs) -> (*outs,
    *residuals)`` and backward ``(*param inputs, *residuals, *cotangents) -> grads``.
    ``params``: the positions of the parameter rows, whose views the backward recomputes.
    ``saves`` ([Note: selective recompute]): the predicate saying which forward ops' outputs
    are kept; the backward computes every other forward value it needs again (``save``: it
    keeps what autograd would). The third value: whether ``saves`` kept any op it was asked
    about (the one place a predicate is asked)."""
    places = [n for n in joint.nodes if n.op == "placeholder"]
    out_node = next(n for n in joint.nodes if n.op == "output")
    outs, grad_nodes = out_node.args[0][:outputs], out_node.args[0][outputs:]
    assert len(grad_nodes) == grads
    inputs, seeds = places[:-outputs], places[-outputs:]
    rows = {places[i] for i in params}
    forward_side = _forward_side(joint, outs, seeds)
    backward_side = {n for n in joint.nodes if n.op == "call_function" and n not in forward_side}
    backward_side.update(seeds)
    for node in joint.nodes:
        ins = node.all_input_nodes
        if (node.op == "call_function" and ins and all(a in rows for a in ins)
                and _is_view(node)):
            rows.add(node)  # a view of a parameter row: recomputed where it is needed
    # a constant (the zeros of a padding's gradient) is made again where needed, not kept as a
    # residual, unless an op writes into it: that write happened in the forward
    rows.update(n for n in joint.nodes if n.op == "call_function" and not n.all_input_nodes
                and n.target in CONSTANT_FACTORIES and not written(n))
    # the backward recomputes what depends on g, the row views and those constants (and,
    # the forward's ops ``saves`` does not keep); everything else it reads (forward values,
    # h, extras) is a residual
    again, kept_any = recomputable(joint, forward_side, saves)
    computed = backward_side | rows | again
    needed = _reach(grad_nodes, lambda m: m.all_input_nodes if m in computed else ())
    residuals = [m for m in joint.nodes if m in needed and m not in computed]

    fwd, env = fx.Graph(), {}
    for p in inputs:
        env[p] = _placeholder(fwd, p.name, p)
    for node in joint.nodes:
        if node.op == "call_function" and node in forward_side:
            env[node] = fwd.node_copy(node, env.__getitem__)
    fwd.output((*(env[o] for o in outs), *(env[m] for m in residuals)))
    fwd.eliminate_dead_code()

    bwd, benv = fx.Graph(), {}
    for i in params:
        benv[places[i]] = _placeholder(bwd, places[i].name, places[i])
    for m in residuals:
        benv[m] = _placeholder(bwd, "saved_" + m.name, m)
    for name, seed in zip(("g", "g_aux"), seeds):
        benv[seed] = _placeholder(bwd, name, seed)
    for node in joint.nodes:
        if node.op == "call_function" and node in needed and node not in benv:
            benv[node] = bwd.node_copy(node, benv.__getitem__)
    bwd.output(tuple(benv[m] for m in grad_nodes))
    bwd.eliminate_dead_code()
    return fwd, bwd, kept_any


def joined(forward: fx.Graph, backward: fx.Graph, params: int, outputs: int = 1) -> fx.Graph:
    """``forward`` then ``backward`` as one graph, ``(*inputs, *cotangents) -> grads``: the
    recompute's (``fz3.step.programs.Layers.recompute``). Each residual is read where the
    forward computed it, and what only the layer's outputs needed (its last ``mm``, the
    residual ``add``) is not computed: dead code, except ops that draw random numbers or
    write in place (impure), so the RNG is drawn as by the forward (in Python; inductor drops
    a draw nothing reads: ``unread_random``)."""
    graph, env = fx.Graph(), {}
    ins = [n for n in forward.nodes if n.op == "placeholder"]
    places = [n for n in backward.nodes if n.op == "placeholder"]
    for p in ins:
        env[p] = _placeholder(graph, p.name, p)
    seeds = places[len(places) - outputs:]
    benv = {s: _placeholder(graph, s.name, s) for s in seeds}
    for node in forward.nodes:
        if node.op == "call_function":
            env[node] = graph.node_copy(node, env.__getitem__)
    kept = next(n for n in forward.nodes if n.op == "output").args[0][outputs:]
    benv.update(zip(places[:params], (env[p] for p in ins[:params])))
    benv.update(zip(places[params:len(places) - outputs], (env[r] for r in kept)))
    for node in backward.nodes:
        if node.op == "call_function":
            benv[node] = graph.node_copy(node, benv.__getitem__)
    out = next(n for n in backward.nodes if n.op == "output")
    graph.output(tuple(benv[m] for m in out.args[0]))
    graph.eliminate_dead_code()
    return graph


# [Note: selective recompute]
# A predicate (``fz3.schedule.saveable``; ``Policy(activations="selective")`` keeps the
# outputs of the compute-heavy ops, ``fz3.keep`` names others, a user's function chooses by
# node) says which forward ops' outputs are kept; the backward program recomputes the rest
# from them, the layer's input, its extras and the re-gathered parameter rows: the
# same ATen ops on the same values, so the results are bitwise those of eager autograd. What
# is never recomputed, its output kept without asking the predicate: an op that draws random
# numbers (dropout's mask is the forward's own, no RNG is replayed; an attention kernel at
# ``dropout_p=0`` draws none and is asked), an op that writes in place, and any value that is
# written into or read from something written into (recomputing it would read the written
# value). The recomputed ops run at the start of the backward program, in forward order,
# each freed after its last use.

def recomputable(joint: fx.Graph, forward_side: set[fx.Node], saves: Saveable
                 ) -> tuple[set[fx.Node], bool]:
    """The forward's ops a backward computes again, ``saves`` keeping the rest (see the Note
    above; none for ``save``), and whether ``saves`` kept any op it was asked about. Only an
    ATen op that may be recomputed is asked: not a ``getitem`` (kept with its op), nor a random
    or in-place op, nor one reading a written value (kept without asking)."""
    if saves is save:
        return set(), True

    def linked(n: fx.Node) -> list[fx.Node]:  # its views, and what it is a view of
        of = _is_view(n) and n.args and isinstance(n.args[0], fx.Node)
        return [*_views(n), *(n.args[:1] if of else ())]

    # written into, and every view of or into such a value
    touched = _reach([v for node in joint.nodes for v in written_args(node)], linked)
    out: set[fx.Node] = set()
    kept_any = False
    for node in joint.nodes:  # in order: a getitem after the op it picks from
        if node.op != "call_function" or node not in forward_side or node in touched:
            continue
        if node.target is operator.getitem:
            if node.args[0] in out:
                out.add(node)
        elif (_draws_random(node) or written_args(node)
              or any(a in touched for a in node.all_input_nodes)):
            continue  # kept, not asked
        elif isinstance(node.target, torch._ops.OpOverload) and keeps(saves, node):
            kept_any = True
        else:
            out.add(node)
    return out, kept_any


def _forward_side(joint: fx.Graph, outs: Sequence[fx.Node], seeds: Sequence[fx.Node]
                  ) -> set[fx.Node]:
    """What the forward computes: the ancestors of the layer's outputs (h, and its aux), with
    every op that writes into one of them or draws random numbers (where eager autograd runs
    them, in the forward), their ancestors, and every op before the last such write. The rest
    of the joint graph is the backward's, so a part of a derivative formula that needs no
    cotangent (``pow``'s ``2 * x``) is computed there from what the forward keeps, as autograd
    does, instead of being kept itself."""
    side = _reach(outs, _inputs)
    depends_on_g = set(seeds)
    for node in joint.nodes:
        if any(a in depends_on_g for a in node.all_input_nodes):
            depends_on_g.add(node)
    order = list(joint.nodes)
    grew = True
    while grew:
        grew = False
        for node in joint.nodes:
            if node in side or node in depends_on_g or node.op != "call_function":
                continue
            if _writes_into(node, side) or _draws_random(node):
                side |= _reach([node], _inputs)
                grew = True
        # A value read before an op writes into it is read as it was: what the trace ran
        # before the forward's last write (autograd's copy of an in-place op's input for its
        # derivative: ``div_``'s original ``self``, cloned before the write) runs there, in the
        # forward, as eager runs it; in the backward it would read the written value (MoE
        # routers normalise their top-k weights in place: their gradient was wrong)
        writes = [i for i, n in enumerate(order) if n in side and written_args(n)]
        before = {n for n in order[:writes[-1]] if n.op == "call_function"
                  and n not in depends_on_g} if writes else set()
        if not before <= side:
            side |= before
            grew = True
    # an output of a forward op with several (layer norm's mean and rstd): picked out where
    # the op runs, so a residual is always a tensor, never the op's whole tuple
    side |= {n for n in joint.nodes if n.target is operator.getitem and n.args[0] in side
             and n not in depends_on_g}
    return side


def _writes_into(node: fx.Node, tensors: set[fx.Node]) -> bool:
    """Whether ``node`` writes into one of ``tensors`` or a view of one."""
    for value in written_args(node):
        while value not in tensors and _is_view(value) and value.args:
            value = value.args[0]  # the tensor it is a view of
        if value in tensors:
            return True
    return False


def unread_random(graph: fx.Graph) -> bool:
    """Whether an op of ``graph`` draws random numbers that nothing reads (noise only the
    layer's output needed, in a ``joined`` graph: Python runs it, inductor drops it, and every
    later draw would shift)."""
    return any(n.op == "call_function" and _draws_random(n) and not n.users
               for n in graph.nodes)


def _draws_random(node: fx.Node) -> bool:
    """An op tagged ``nondeterministic_seeded``, unless its ``dropout_p`` is 0 (every SDPA
    kernel is tagged; without dropout it reads no generator and is deterministic)."""
    target = node.target
    if not (isinstance(target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in target.tags):
        return False
    args = target._schema.arguments
    i = next((i for i, a in enumerate(args) if a.name == "dropout_p"), None)
    if i is None:
        return True
    p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", args[i].default_value)
    return not (isinstance(p, (int, float)) and p == 0)


def _placeholder(graph: fx.Graph, name: str, like: fx.Node) -> fx.Node:
    """An input standing for ``like``, with its recorded (fake) value (``fast_ops`` traces
    with it)."""
    node = graph.placeholder(name)
    node.meta["val"] = like.meta.get("val")
    return node


def _reach(roots: Sequence[fx.Node], step: Callable[[fx.Node], Sequence]) -> set[fx.Node]:
    """``roots`` and every node ``step`` leads to from them, and on (``_inputs``: their
    ancestors)."""
    seen: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(step(m))
    return seen


_inputs = operator.attrgetter("all_input_nodes")  # (a ``_reach`` step: the nodes read)


def _views(node: fx.Node) -> list[fx.Node]:
    """The ops reading ``node`` that are views of it."""
    return [u for u in node.users if _is_view(u)]


def _is_view(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def written(node: fx.Node) -> bool:
    """Whether an op writes into ``node``'s tensor or a view of it."""
    return any(n in written_args(user) for n in _reach([node], _views) for user in n.users)


def written_args(node: fx.Node) -> list[fx.Node]:
    """The graph values an op writes into (its schema's mutable arguments)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return []
    out = []
    for i, arg in enumerate(node.target._schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, fx.Node) and arg.alias_info is not None and arg.alias_info.is_write:
            out.append(value)
    return out
