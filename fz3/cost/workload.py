"""What one rank's micro-batch costs, per unit: FLOPs, bytes touched and ATen ops of ``pre``,
one layer and ``post``, counted once by running them on zero parameters under a dispatch
mode (``Workload.from_model``) or in closed form for a transformer (``Workload.transformer``).
``fz3/cost.py`` turns these counts into time on a described cluster."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch


class Work(NamedTuple):
    flops: float = 0.0
    bytes: float = 0.0  # read + written by the ops
    ops: float = 0.0  # ATen ops (kernel launches / dispatches)

    def __add__(self, o: "Work") -> "Work":  # type: ignore[override]
        return Work(self.flops + o.flops, self.bytes + o.bytes, self.ops + o.ops)

    def scale(self, k: float) -> "Work":
        return Work(self.flops * k, self.bytes * k, self.ops * k)


class Workload(NamedTuple):
    """One rank's micro-batch through one model, counted per unit."""

    num_layers: int
    outer_numel: int  # parameters outside the stack
    layer_numel: int  # parameters per layer
    pre_fwd: Work
    pre_bwd: Work
    layer_fwd: Work
    layer_bwd: Work
    post: Work  # forward and backward of post + loss
    act_bytes: float  # one layer's input activation (saved by recompute)
    layer_graph_bytes: float  # what autograd keeps for one layer (saved by forward_save)
    tokens: int  # per rank per micro-batch
    param_bytes: int = 4  # compute dtype
    grad_bytes: int = 4  # reduce dtype
    pre_graph_bytes: float = 0.0  # what autograd keeps for pre's graph (kept until its backward)
    post_graph_bytes: float = 0.0  # ... for post + loss (alive during the loss op)

    @property
    def params(self) -> int:
        return self.outer_numel + self.num_layers * self.layer_numel

    @staticmethod
    def from_model(model: Any, batch: Any) -> "Workload":
        """Count a ShardedModel's units on ``batch``: one run of ``pre``, one layer and ``post``
        (forward and backward) on zero parameters, locally, under a FLOP and op counter."""
        from ..observe.activations import activation_sizes
        from ..sharding import compute

        cnt = OpCounter()
        dtype, dev = model.precision.compute, model.device

        def leaves(layout):
            return compute.leaves(layout.views(torch.zeros(layout.padded, dtype=dtype, device=dev)))

        outer = leaves(model.outer)
        with cnt.phase("pre_fwd"):
            h, extras = compute.run_pre(model, outer, batch)
        with cnt.phase("pre_bwd"):
            if h.requires_grad:
                torch.autograd.grad(h, outer, torch.ones_like(h), allow_unused=True)
        x = h.detach().requires_grad_()
        ex = tuple(e.detach() if isinstance(e, torch.Tensor) else e for e in extras)
        lw = leaves(model.layer)
        with cnt.phase("layer_fwd"):
            out = compute.run_layers(model, 0, [lw], x, ex) if model.num_layers else x
        with cnt.phase("layer_bwd"):
            if model.num_layers:
                torch.autograd.grad(out, [*lw, x], torch.ones_like(out), allow_unused=True)
        with cnt.phase("post"):
            loss, _ = compute.run_loss(model, model.post, False, outer, x, batch)
            torch.autograd.grad(loss, [x, *outer], allow_unused=True)
        act = activation_sizes(model, batch)
        tokens = h.shape[0] * h.shape[1] if h.dim() >= 3 else h.shape[0]
        size = torch.empty((), dtype=dtype).element_size()
        return Workload(model.num_layers, model.outer.numel, model.layer.numel, cnt.work["pre_fwd"],
                        cnt.work["pre_bwd"], cnt.work["layer_fwd"], cnt.work["layer_bwd"], cnt.work["post"],
                        act.layer_input, act.layer_graph, int(tokens), size,
                        torch.empty((), dtype=model.precision.reduce).element_size(), act.pre_graph,
                        act.post_graph)

    @staticmethod
    def transformer(layers: int, hidden: int, ffn: int, vocab: int, seq: int, micro_batch: int, *,
                    positions: int = 0, param_bytes: int = 2, grad_bytes: int = 4, kv_dim: int | None = None,
                    gated: bool = False, flash: bool = True) -> "Workload":
        """A pre-LN transformer in closed form (Megatron's counts): per layer 2h^2 + 2h*kv_dim
        attention weights (kv_dim = h without grouped-query attention) and 2h*ffn MLP weights
        (3h*ffn when ``gated``, SwiGLU); matmul FLOPs 2 x tokens x weights, attention scores
        and values 4 x tokens x seq x h; backward twice the forward."""
        t = seq * micro_batch
        w_layer = 2 * hidden * hidden + 2 * hidden * (kv_dim or hidden) + (3 if gated else 2) * hidden * ffn
        fwd = Work(2 * t * w_layer + 4 * t * seq * hidden, bytes=param_bytes * (w_layer + 12 * t * hidden), ops=25)
        head = Work(2 * t * hidden * vocab * 3, bytes=param_bytes * (hidden * vocab + 3 * t * vocab), ops=12)
        graph = t * hidden * param_bytes * 17 + (0 if flash else micro_batch * seq * seq * param_bytes * 2)
        outer = vocab * hidden + positions * hidden + 2 * hidden
        return Workload(layers, outer, w_layer + 9 * hidden + ffn, Work(0, t * hidden * param_bytes * 3, 4),
                        Work(0, t * hidden * param_bytes * 3, 4), fwd, fwd.scale(2.0), head,
                        t * hidden * param_bytes, graph, t, param_bytes, grad_bytes,
                        pre_graph_bytes=t * hidden * param_bytes,  # the embedding's output (dropout mask)
                        post_graph_bytes=t * vocab * (param_bytes + 4))  # logits, and fp32 softmax for the loss


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
                    tensors = [t for t in optree.tree_leaves((args, out)) if isinstance(t, torch.Tensor)]
                    self.bytes += sum(t.numel() * t.element_size() for t in tensors)
                return out

            def __exit__(self, *exc):
                super().__exit__(*exc)
                counter.work[name] = Work(float(self.flops), self.bytes, self.ops)

        return Count()


_FREE = {getattr(torch.ops.aten, n) for n in ("view", "_unsafe_view", "t", "transpose", "permute", "expand",
                                             "detach", "alias", "split", "split_with_sizes", "slice", "select",
                                             "unsqueeze", "squeeze", "as_strided", "reshape", "_reshape_alias")}

