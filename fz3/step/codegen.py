"""Traced graphs as Python programs: each op called through its C++ binding, values dropped
after their last use (``codegen``), the Python binding eager PyTorch uses where a re-trace shows
it dispatches the very same ATen op (``fast_ops``), parameter views and a flat gradient made in
one call each (``one_call_views``, ``fz3.step.views``; ``one_call_flatten``), constant zeros
made once (``constant_factories``). ``fz3.step.joint`` makes the graphs.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from .views import RowViews


class TraceError(Exception):
    """The layer cannot be traced into programs (it runs through autograd instead)."""


def one_call_views(graph: fx.Graph, params: int, shared: dict[int, RowViews]) -> None:
    """``split_with_sizes(row)`` and a ``view`` of each piece -> one ``RowViews`` call, the
    one in ``shared`` for that row (by position; another program of the layer's made it)
    where its pieces have this split's sizes and those this graph reads its shapes, else a
    new one, put there. The program takes a keyword more, ``made`` (``RowViews``')."""
    rows = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(rows[-1]):
        kept = graph.placeholder("made", default_value=None)
    rows = rows[:params]
    split_op, view_op = torch.ops.aten.split_with_sizes.default, torch.ops.aten.view.default
    calls: dict[int, fx.Node] = {}  # row position -> this graph's call of its views
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
        position = rows.index(split.args[0])
        views = shared.get(position)
        if views is None or [math.prod(x) for x in views.shapes] != list(split.args[1]) or \
                any(views.shapes[i] != shapes[i] for i in replaced):
            views = shared[position] = RowViews(shapes)
        # a second split of the row in this graph (a recompute's backward half) reads the
        # first one's call
        node = calls.get(position)
        if node is None or node.target is not views:
            with graph.inserting_after(split):
                node = calls[position] = graph.call_function(views, (split.args[0], kept))
        made = {}
        for i, old in replaced.items():
            with graph.inserting_after(node):
                piece = graph.call_function(operator.getitem, (node, i))
            old.replace_all_uses_with(piece)
            made[piece] = i
        _derive(graph, node, views, made)
        graph.eliminate_dead_code()


# View ops that a program takes of a parameter's view (a weight's ``t`` for ``mm``), each
# with the Python binding that dispatches it for integer arguments: ``RowViews.derive`` makes
# them once per row
_T = torch._C.TensorBase
VIEW_OPS = {torch.ops.aten.t.default: _T.t, torch.ops.aten.transpose.int: _T.transpose,
            torch.ops.aten.permute.default: _T.permute, torch.ops.aten.view.default: _T.view,
            torch.ops.aten.unsqueeze.default: _T.unsqueeze,
            torch.ops.aten.squeeze.dim: _T.squeeze}


def _derive(graph: fx.Graph, node: fx.Node, views: RowViews, made: dict[fx.Node, int]) -> None:
    """Each ``VIEW_OPS`` node on one of ``views``' results (``made``: result node -> its
    position; constant other arguments) -> a result of ``views`` too (``RowViews.derive``)."""
    for n in list(graph.nodes):
        if n.target not in VIEW_OPS or n.args[0] not in made or n.kwargs or \
                n.all_input_nodes != [n.args[0]] or \
                not all(isinstance(a, (int, list, tuple)) for a in n.args[1:]):
            continue
        position = views.derive(made[n.args[0]], VIEW_OPS[n.target], tuple(n.args[1:]))
        with graph.inserting_after(node):
            new = graph.call_function(operator.getitem, (node, position))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        made[new] = position


# Ops that make a tensor from nothing but their arguments, the same every call (no RNG).
CONSTANT_FACTORIES = frozenset({torch.ops.aten.zeros.default, torch.ops.aten.ones.default,
                                torch.ops.aten.full.default,
                                torch.ops.aten.scalar_tensor.default})


def _copies_its_inputs(node: fx.Node) -> bool:
    """Whether ``node`` only reads its tensor inputs and returns new memory (not
    ``flatten_dense_tensors`` of one tensor: a view of it)."""
    return node.target is torch.ops.aten.cat.default or (
        node.target is torch._C._nn.flatten_dense_tensors and len(node.args[0]) > 1)


def constant_factories(graph: fx.Graph) -> None:
    """A ``CONSTANT_FACTORIES`` node read only by ops that copy it (the zeros of a padding's
    gradient, read by the flat gradient's ``cat``) -> a tensor made once, here: ``codegen``
    makes it a constant of the program, which never writes to it, nor lets it out."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in CONSTANT_FACTORIES or \
                node.all_input_nodes or not all(_copies_its_inputs(u) for u in node.users):
            continue
        value = node.target(*node.args, **node.kwargs)
        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, lambda a: value if a is node else a)
        graph.erase_node(node)


def one_call_flatten(graph: fx.Graph) -> None:
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


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph``, node for node, that passes may change."""
    new = fx.Graph()
    new.output(new.graph_copy(graph, {}))
    return new


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
    last_use = {a: i for i, node in enumerate(nodes) for a in node.all_input_nodes}
    params, keywords, lines = [], [], []
    for i, node in enumerate(nodes):
        names[node] = f"v{i}"
        if node.op == "placeholder":
            if node.args:  # ``made`` (``one_call_views``): a keyword, last
                names[node] = node.name
                keywords.append(f"{node.name}=None")
            else:
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
            lines.append(f"v{i} = {expr(_callee(node.target, slow))}({', '.join(args)})")
        dead = [names[a] for a in node.all_input_nodes if last_use[a] == i]
        if dead:
            lines.append(" = ".join(dead) + " = None")
    if boxed:
        lines = [f"{', '.join(params)}, = args", "args.clear()", *lines]
        params = ["args"]
    source = f"def {name}({', '.join(params + keywords)}):\n" + \
        "".join(f"    {ln}\n" for ln in lines)
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
    """The graph ``make_fx`` records for ``fn`` on inputs like ``examples`` (fake: none runs)."""
    inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
              for v in examples]
    call = (lambda *xs: fn(list(xs))) if boxed else fn
    with torch.no_grad():
        graph = make_fx(call, tracing_mode="fake")(*inputs).graph
    graph.eliminate_dead_code()  # the tracer names every piece of a multi-output op
    return graph


def _callee(target: Any, slow: frozenset | None) -> Any:
    """What a node's code calls: an op's Python binding where ``slow`` allows it, else its
    C++ entry (``OpOverload._op``); any other target as it is."""
    if isinstance(target, torch._ops.OpOverload):
        quick = None if slow is None or target in slow else _binding(target)
        return quick if quick is not None else target._op
    return target


def _binding(op: torch._ops.OpOverload) -> Callable | None:
    """The Python binding eager PyTorch calls for ``op``'s name (``torch.mm``, ``Tensor.view``)."""
    base = op._schema.name.split("::")[-1]
    for namespace in (torch._C._VariableFunctions, torch._C._nn, torch._C._linalg,
                      torch._C._special, torch._C.TensorBase):
        fn = getattr(namespace, base, None)
        if fn is not None:
            return fn
    return None
