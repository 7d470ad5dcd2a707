"""A layer's pure function, traced once into two plain programs: forward and backward.

The autograd engine is the largest host cost of a per-layer executor: every layer pays one
``torch.autograd.grad`` call and the engine's bookkeeping per op (``benchmarks/host_floor.py``).
A layer of a stack is a pure function ``f(row, frozen_row, h, *extras) -> h``, so its
derivative can be traced ahead of time instead: ``make_fx`` of ``f`` followed by
``torch.autograd.grad`` records the forward and the backward ATen ops of one call in a single
joint graph, with fake tensors
(a tensor's value read on the host, a data-dependent branch, fails the trace; nothing is
computed, no RNG is drawn). The graph is cut where AOTAutograd's default partitioner cuts it:

- backward: every node that depends on the cotangent ``g``, and the views of the parameter
  rows it reads (recomputed from the re-gathered row, so no residual aliases a gathered
  buffer that ``free`` releases);
- forward: everything else; the forward nodes the backward reads are its residuals, kept
  between the two as a tuple of tensors (what autograd would have saved).

Both halves become Python functions calling each op's C++ binding directly, with every
intermediate dropped after its last use (``codegen``), or go to inductor (``fz3.step.traced``).
They compute the same ATen ops with the same derivative formulas as eager autograd, in the
same order, so results are bitwise equal to it (``tests/test_traced.py``).
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

Layer = Callable[..., torch.Tensor]  # (row, frozen_row | None, h, *extras) -> h


class Programs(NamedTuple):
    """One layer's traced halves. ``forward(*inputs) -> (h, *residuals)``;
    ``backward([row, frozen_row, *residuals, g]) -> (grad_row, grad_h, *grad_extras)`` (the
    differentiable extras, in order; one list, emptied by the call); ``inference(*inputs) ->
    (h,)`` for forwards without gradient. ``inputs`` are ``(row, frozen_row, h,
    *tensor_extras)``, ``frozen_row`` left out when the layer has none. The graphs are kept
    for inductor; ``source`` identifies the code."""

    forward: Callable[..., tuple]
    backward: Callable[..., tuple]
    inference: Callable[..., torch.Tensor]
    graphs: tuple[fx.Graph, fx.Graph, fx.Graph]
    source: str
    # a residual may share storage with a parameter row (then the executor keeps the row's
    # storage object across free and re-gather, as for an autograd graph)
    aliases_params: bool = True


class TraceError(Exception):
    """The layer cannot be traced into programs (it runs through autograd instead)."""


def trace(layer: Layer, inputs: Sequence[torch.Tensor], frozen: bool,
          differentiable: Sequence[int]) -> Programs:
    """Trace ``layer`` on ``inputs`` = ``(row, [frozen_row,] h, *tensor_extras)``.
    ``differentiable``: positions in ``tensor_extras`` whose gradient the backward returns.
    Raises ``TraceError`` naming why a layer cannot be traced."""
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
    _fold_transposes(joint_gm.graph)
    fwd, bwd = partition(joint_gm.graph, params=range(first), grads=len(wrt))
    aliases = _residuals_alias_params(fwd, params=first)
    # Forwards without gradient run the forward's ops, residuals not returned: the same
    # kernels as the recompute that follows them (eager may pick others without grad mode)
    graphs = (fwd, bwd, _forward_only(fwd))  # for inductor, as traced
    slow_f, slow_b = fast_ops(fwd), fast_ops(bwd, boxed=True)
    # for Python, a copy with the parameter views made and the gradient flattened in one
    # call each (a dozen ops fewer per program; nothing inductor could compile)
    fwd, bwd, inf = (_copy(g) for g in graphs)
    for g in (fwd, bwd, inf):
        _one_call_views(g, params=first)
    _one_call_flatten(bwd)
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
    backward_side: set[fx.Node] = {places[-1]}
    for node in joint.nodes:
        if node.op != "call_function":
            continue
        ins = node.all_input_nodes
        if any(a in backward_side and a not in rows for a in ins):
            backward_side.add(node)  # depends on g
        elif ins and all(a in rows for a in ins) and _is_view(node):
            rows.add(node)  # a view of a parameter row: recomputed where it is needed
    # the backward recomputes what depends on g and the row views; everything else it reads
    # (forward values, h, extras) is a residual
    computed = backward_side | rows
    needed = _ancestors(grad_nodes, stop=lambda m: m not in computed)
    residuals = [m for m in joint.nodes if m in needed and m not in computed]

    fwd, env = fx.Graph(), {}
    for p in places[:-1]:
        env[p] = _placeholder(fwd, p.name, p)
    for node in joint.nodes:
        if node.op == "call_function" and node not in backward_side:
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


class _Views:
    """``row -> views`` of consecutive pieces of it, shaped as given: what
    ``FlatLayout.views``' split and views do, in one C++ call."""

    __name__ = "views"  # a node's target needs one

    def __init__(self, shapes: Sequence[tuple[int, ...]]):
        self.templates = [torch.empty(shape, device="meta") for shape in shapes]

    def __call__(self, row: torch.Tensor) -> list[torch.Tensor]:
        return torch._C._nn.unflatten_dense_tensors(row, self.templates)

    def __repr__(self) -> str:
        return f"views{[tuple(t.shape) for t in self.templates]}"


def _one_call_views(graph: fx.Graph, params: int) -> None:
    """``split_with_sizes(row)`` and a ``view`` of each piece -> one ``_Views`` call."""
    rows = [n for n in graph.nodes if n.op == "placeholder"][:params]
    split_op, view_op = torch.ops.aten.split_with_sizes.default, torch.ops.aten.view.default
    for split in [n for n in graph.nodes if n.target is split_op and n.args[0] in rows]:
        pieces = {u.args[1]: u for u in split.users if u.target is operator.getitem}
        if len(pieces) != len(split.users):
            continue
        shapes, replaced = [], {}
        for i, size in enumerate(split.args[1]):
            piece = pieces.get(i)
            users = list(piece.users) if piece is not None else []
            if len(users) == 1 and users[0].target is view_op:
                shapes.append(tuple(users[0].args[1]))
                replaced[i] = users[0]
            else:
                shapes.append((size,))
                if piece is not None:
                    replaced[i] = piece
        with graph.inserting_after(split):
            views = graph.call_function(_Views(shapes), (split.args[0],))
        for i, old in replaced.items():
            with graph.inserting_after(views):
                old.replace_all_uses_with(graph.call_function(operator.getitem, (views, i)))
        graph.eliminate_dead_code()


def _one_call_flatten(graph: fx.Graph) -> None:
    """The row's gradient, ``cat`` of 1-D ``view`` s of each parameter's gradient -> one
    ``flatten_dense_tensors`` call (the same copy of the same values)."""
    out = next(n for n in graph.nodes if n.op == "output")
    cat = out.args[0][0]
    if cat.target is not torch.ops.aten.cat.default or len(cat.args) != 1:
        return
    sources = []
    for piece in cat.args[0]:
        if piece.target is torch.ops.aten.view.default and len(piece.args[1]) == 1:
            sources.append(piece.args[0])
        elif len(piece.meta.get("val", torch.empty(0, 0)).shape) == 1:
            sources.append(piece)
        else:
            return
    with graph.inserting_before(cat):
        flat = graph.call_function(torch._C._nn.flatten_dense_tensors, (sources,))
    cat.replace_all_uses_with(flat)
    graph.eliminate_dead_code()


def codegen(graph: fx.Graph, name: str, *, boxed: bool = False,
            slow: frozenset | None = None) -> tuple[Callable, str]:
    """A Python function running ``graph``'s nodes in order, each op through its C++ binding
    (``OpOverload._op``: no Python frame per op), each value dropped after its last use.
    ``boxed``: it takes its arguments as one list and empties it, so that a residual is freed
    after its last use in the backward, as autograd frees saved tensors (the caller keeps no
    other reference). ``slow``: None calls every op through ``OpOverload._op`` (the boxed
    path); a set calls the others through their Python binding (``torch.mm``, ``Tensor.view``:
    the unboxed fast path eager PyTorch takes, about half the host time per op), which
    ``fast_ops`` checks dispatches the same ops. Returns (function, source)."""
    names: dict[fx.Node, str] = {}
    constants: dict[str, Any] = {}

    def expr(v: Any) -> str:
        if isinstance(v, fx.Node):
            return names[v]
        if isinstance(v, (list, tuple)):
            inner = ", ".join(expr(a) for a in v)
            return f"[{inner}]" if isinstance(v, list) else f"({inner}{',' if len(v) == 1 else ''})"
        if v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float)
                                                             and math.isfinite(v)):
            return repr(v)
        key = f"k{len(constants)}"
        constants[key] = v
        return key

    nodes = list(graph.nodes)
    last_use = {}
    for i, node in enumerate(nodes):
        for a in node.all_input_nodes:
            last_use[a] = i
    params, lines = [], []
    for i, node in enumerate(nodes):
        names[node] = f"v{i}"
        if node.op == "placeholder":
            params.append(names[node])
            continue
        if node.op == "output":
            lines.append(f"return {expr(node.args[0])}")
            continue
        if node.op != "call_function":
            raise TraceError(f"the trace has a {node.op} node ({node.target})")
        args = [expr(a) for a in node.args] + [f"{k}={expr(v)}" for k, v in node.kwargs.items()]
        if node.target is operator.getitem:
            lines.append(f"v{i} = {args[0]}[{args[1]}]")
        else:
            target = node.target
            if isinstance(target, torch._ops.OpOverload):
                quick = None if slow is None or target in slow else _binding(target)
                target = quick if quick is not None else target._op
            fn = expr(target)
            lines.append(f"v{i} = {fn}({', '.join(args)})")
        dead = [names[a] for a in node.all_input_nodes if last_use[a] == i]
        if dead:
            lines.append(" = ".join(dead) + " = None")
    if boxed:
        lines = [f"{', '.join(params)}, = args", "args.clear()", *lines]
        params = ["args"]
    source = f"def {name}({', '.join(params)}):\n" + "".join(f"    {ln}\n" for ln in lines)
    scope = dict(constants)
    exec(compile(source, f"<fz3 traced {name}>", "exec"), scope)  # noqa: S102 - our own codegen
    return scope[name], source


def fast_ops(graph: fx.Graph, *, boxed: bool = False) -> frozenset | None:
    """The ops of ``graph`` that ``codegen`` must call through ``_op`` (None: all of them):
    every other op's Python binding dispatches the very same ATen op with the same arguments.
    Checked by tracing the program again (``make_fx``, fake inputs like the graph's own):
    its graph must be ``graph``, node for node. An op whose binding picks another overload
    (``torch.div(x, 2.0)`` is ``div.Tensor``, the graph's ``div.Scalar``) goes to ``_op``."""
    examples = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    if any(not isinstance(v, torch.Tensor) for v in examples):
        return None
    want = _structure(graph)
    slow: frozenset = frozenset()
    for _ in range(3):
        try:
            got = _structure(_retrace(codegen(graph, "check", boxed=boxed, slow=slow)[0],
                                      examples, boxed))
        except Exception:  # noqa: BLE001 - a binding that cannot take these arguments
            return None
        if got == want:
            return slow
        if len(got) != len(want):
            return None
        differ = {w[0] for g, w in zip(got, want) if g != w and isinstance(w[0], str)}
        ops = frozenset(n.target for n in graph.nodes if str(n.target) in differ)
        if not ops - slow:
            return None
        slow |= ops
    return None


def _structure(graph: fx.Graph) -> list:
    """``graph`` as comparable data: each node's kind, op and arguments, nodes by position."""
    position = {n: i for i, n in enumerate(graph.nodes)}

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("node", position[a])
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        return a

    def call(n: fx.Node) -> tuple:
        if not isinstance(n.target, torch._ops.OpOverload):
            return (str(n.target) if n.op == "call_function" else n.op, arg(n.args))
        # every argument of the schema, defaults filled in: an explicit default is no change
        values = []
        for i, a in enumerate(n.target._schema.arguments):
            if i < len(n.args):
                values.append(arg(n.args[i]))
            elif a.name in n.kwargs:
                values.append(arg(n.kwargs[a.name]))
            else:
                values.append(a.default_value if a.has_default_value() else None)
        return (str(n.target), tuple(values))

    return [call(n) for n in graph.nodes]


def _retrace(fn: Callable, examples: list, boxed: bool) -> fx.Graph:
    """The graph ``make_fx`` records for ``fn`` on inputs like ``examples`` (fake: nothing
    runs)."""
    inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
              for v in examples]
    call = (lambda *xs: fn(list(xs))) if boxed else fn
    with torch.no_grad():
        graph = make_fx(call, tracing_mode="fake")(*inputs).graph
    graph.eliminate_dead_code()  # the tracer names every piece of a multi-output op
    return graph


def _binding(op: torch._ops.OpOverload) -> Callable | None:
    """The Python binding eager PyTorch calls for ``op``'s name (``torch.mm``, ``Tensor.view``)."""
    base = op._schema.name.split("::")[-1]
    for namespace in (torch._C._VariableFunctions, torch._C._nn, torch._C._linalg,
                      torch._C._special, torch._C.TensorBase):
        fn = getattr(namespace, base, None)
        if fn is not None:
            return fn
    return None
