"""What one rank's micro-batch costs, per part: FLOPs, bytes touched and ATen ops of each
function (one layer of each stack), counted once by running them on zero parameters under a
dispatch mode (``Workload.from_model``) or in closed form for a transformer
(``Workload.transformer``). ``fz3/cost/estimate.py`` turns these counts into time on a
described cluster."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ..observe.activations import activation_sizes, walk_parts
from ..schedule.structure import PartShape, Role


class Work(NamedTuple):
    flops: float = 0.0
    bytes: float = 0.0  # read + written by the ops
    ops: float = 0.0  # ATen ops (kernel launches / dispatches)

    def __add__(self, o: "Work") -> "Work":  # type: ignore[override]
        return Work(self.flops + o.flops, self.bytes + o.bytes, self.ops + o.ops)

    def scale(self, k: float) -> "Work":
        return Work(self.flops * k, self.bytes * k, self.ops * k)


class PartWork(NamedTuple):
    """One part of the model, per row (per layer for a stack)."""

    name: str
    role: Role
    rows: int  # layers of a stack; 1 otherwise
    numel: int  # parameters per row
    fwd: Work  # post: forward and backward of post + loss together
    bwd: Work = Work()
    input_bytes: float = 0.0  # a row's input activation (kept by recompute)
    graph_bytes: float = 0.0  # what autograd keeps for a row's graph
    reads: tuple[int, ...] = ()  # shared parts its compute reads


class Workload(NamedTuple):
    """One rank's micro-batch through one model, counted per part."""

    parts: tuple[PartWork, ...]
    tokens: int  # per rank per micro-batch
    param_bytes: int = 4  # compute dtype
    grad_bytes: int = 4  # reduce dtype

    @property
    def params(self) -> int:
        return sum(p.rows * p.numel for p in self.parts)

    @property
    def num_layers(self) -> int:
        return sum(p.rows for p in self.parts if p.role is Role.STACK)

    @property
    def structure(self) -> tuple[PartShape, ...]:
        return tuple(PartShape(p.name, p.role, p.rows, p.reads) for p in self.parts)

    @staticmethod
    def from_model(model: Any, batch: Any) -> "Workload":
        """Count a ShardedModel's parts on ``batch``: one run of each function (one layer of
        each stack), forward and backward, on zero parameters, locally, under a FLOP and op
        counter."""
        cnt = OpCounter()
        tokens = [0]

        def measure(i, run, params, inputs, layer):
            with cnt.phase(f"fwd{i}"):
                out = run()
            h = out[0] if isinstance(out, tuple) else out
            if model.parts[i].role is Role.PRE:
                tokens[0] = h.shape[0] * h.shape[1] if h.dim() >= 3 else h.shape[0]
            wrt = [t for t in (*params, *inputs) if t.requires_grad]
            with cnt.phase(f"bwd{i}"):
                if h.requires_grad and wrt:
                    torch.autograd.grad(h, wrt, torch.ones_like(h), allow_unused=True)
            return out

        walk_parts(model, batch, measure)
        act = activation_sizes(model, batch)
        parts = []
        for i, p in enumerate(model.parts):
            fwd, bwd = cnt.work.get(f"fwd{i}", Work()), cnt.work.get(f"bwd{i}", Work())
            if p.role is Role.POST:  # the loss op runs both
                fwd, bwd = fwd + bwd, Work()
            parts.append(PartWork(p.name, p.role, p.rows, p.layout.numel, fwd, bwd, act[i].input,
                                  act[i].graph, p.reads))
        size = torch.empty((), dtype=model.precision.compute).element_size()
        return Workload(tuple(parts), int(tokens[0]), size,
                        torch.empty((), dtype=model.precision.reduce).element_size())

    @staticmethod
    def transformer(layers: int, hidden: int, ffn: int, vocab: int, seq: int, micro_batch: int, *,
                    positions: int = 0, param_bytes: int = 2, grad_bytes: int = 4,
                    kv_dim: int | None = None, gated: bool = False, flash: bool = True,
                    tied: bool = True) -> "Workload":
        """A pre-LN transformer in closed form (Megatron's counts): per layer 2h^2 + 2h*kv_dim
        attention weights (kv_dim = h without grouped-query attention) and 2h*ffn MLP weights
        (3h*ffn when ``gated``, SwiGLU); matmul FLOPs 2 x tokens x weights, attention scores
        and values 4 x tokens x seq x h; backward twice the forward. ``tied``: the LM head is
        the token embedding (one shared part read by pre and post)."""
        t = seq * micro_batch
        w_layer = (2 * hidden * hidden + 2 * hidden * (kv_dim or hidden)
                   + (3 if gated else 2) * hidden * ffn)
        fwd = Work(2 * t * w_layer + 4 * t * seq * hidden,
                   bytes=param_bytes * (w_layer + 12 * t * hidden), ops=25)
        head = Work(2 * t * hidden * vocab * 3,
                    bytes=param_bytes * (hidden * vocab + 3 * t * vocab), ops=12)
        graph = (t * hidden * param_bytes * 17
                 + (0 if flash else micro_batch * seq * seq * param_bytes * 2))
        embed = Work(0, t * hidden * param_bytes * 3, 4)
        table = vocab * hidden
        parts = (
            PartWork("pre", Role.PRE, 1, positions * hidden + (0 if tied else table), embed, embed,
                     graph_bytes=t * hidden * param_bytes,  # the embedding's output
                     reads=(3,) if tied else ()),
            PartWork("layers", Role.STACK, layers, w_layer + 9 * hidden + ffn, fwd, fwd.scale(2.0),
                     t * hidden * param_bytes, graph),
            PartWork("post", Role.POST, 1, 2 * hidden + (0 if tied else table), head,
                     graph_bytes=t * vocab * (param_bytes + 4),  # logits, fp32 softmax
                     reads=(3,) if tied else ()),
        ) + ((PartWork("tied:embedding", Role.SHARED, 1, table, Work()),) if tied else ())
        return Workload(parts, t, param_bytes, grad_bytes)


class OpCounter:
    """Counts FLOPs (torch's flop formulas), bytes touched and ATen ops per phase, with a
    dispatch mode: a measurement at estimate time, no hooks on the model."""

    def __init__(self) -> None:
        self.work: dict[str, Work] = {}

    def phase(self, name: str):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        counter = self

        class Count(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.flops = self.ops = 0
                self.bytes = 0.0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                packet = func.overloadpacket
                if packet in flop_registry:
                    self.flops += flop_registry[packet](*args, **kwargs, out_val=out)
                if packet not in _FREE:
                    self.ops += 1
                    tensors = [t for t in optree.tree_leaves((args, out))
                               if isinstance(t, torch.Tensor)]
                    self.bytes += sum(t.numel() * t.element_size() for t in tensors)
                return out

            def __exit__(self, *exc):
                super().__exit__(*exc)
                counter.work[name] = Work(float(self.flops), self.bytes, self.ops)

        return Count()


_FREE = {getattr(torch.ops.aten, n)
         for n in ("view", "_unsafe_view", "t", "transpose", "permute", "expand", "detach", "alias",
                   "split", "split_with_sizes", "slice", "select", "unsqueeze", "squeeze",
                   "as_strided", "reshape", "_reshape_alias")}

