"""Traced layers (the default, ``trace=True``): each layer's forward and backward run as
programs traced once from its function (``fz3.step.joint``), without the autograd engine.

Reference: the same step with ``trace=False`` (the layer's Python through autograd, itself
tested against plain PyTorch autograd on the unsharded model in ``test_core`` and
``test_golden``). Tolerance: none, bit for bit: the programs run the same ATen ops with the
same derivative formulas in the same order, and draw the same random numbers (dropout, with
recompute replaying them). Every other test of a step runs the traced path too, since it is
the default. One test compares with plain autograd at fp32's rtol 1e-5 / atol 1e-6 instead: an
input laid out otherwise than traced (a loss's gradient of h that is not contiguous, say) is
copied into the traced layout first, and a layer's backward may then round otherwise than
autograd's on the strided one."""

from __future__ import annotations

import dataclasses
import logging
import re
from types import SimpleNamespace

import optree
import pytest
import torch
from torch import nn

import dist
import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from fz3.step import joint
from reference import (LayerNet, assert_close, batches, concat, gpt, layer_net_plain, layer_post,
                       layer_pre, time_major_post, time_major_pre)

CFG = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=4, dropout=0.2)
POLICIES = (fz3.Policy(), fz3.Policy(activations="save"),
            fz3.Policy(activations="save", layers_per_unit=2), fz3.Policy(layers_per_unit=2))


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)))


def same_as_untraced(model, policy, params, batch):
    """One traced step and one ``trace=False`` step from the same seed: loss, gradients and
    the RNG state after them bitwise equal. Returns the traced step function."""
    torch.manual_seed(1)
    step = fz3.value_and_grad(model, policy)
    loss, grads = step(params, batch)
    after = torch.rand(1)  # the RNG is left where autograd leaves it
    torch.manual_seed(1)
    want_loss, want = fz3.value_and_grad(model, policy, trace=False)(params, batch)
    assert torch.equal(after, torch.rand(1)), policy
    assert torch.equal(loss, want_loss) and _same(grads, want), policy
    return step


def traced_ranks(rank, world):
    model, params = shard_gpt(gpt(CFG))
    bs = batches(CFG, world)
    stack = model.parts[model.part_index("blocks")].name
    for policy in POLICIES:
        step = same_as_untraced(model, policy, params, bs[rank])
        # it ran traced: every layer shares one group, and nothing fell back
        assert step.traced.failed == {} and step.traced.groups[model.part_index("blocks")].own \
            == [0] * CFG.layers, (policy, step.traced.failed)
        assert stack not in step.traced.failed
    torch.manual_seed(2)
    got = fz3.apply(model.eval(), params, bs[rank])
    torch.manual_seed(2)
    assert torch.equal(got, fz3.apply(model.eval(), params, bs[rank], trace=False))
    return "ok"


def test_traced_layers_equal_autograd_bit_for_bit():
    assert dist.run(2, traced_ranks, timeout=300) == ["ok"] * 2


class Lin(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h):
        return h + torch.tanh(self.lin(h))


class ReadsHost(Lin):
    """Reads a tensor's value on the host: a trace cannot see which branch is taken."""

    def forward(self, h):
        return h + self.lin(h) * (2.0 if h.sum().item() > 0 else 1.0)


class WithBuffer(Lin):
    """A constant buffer (never written, no gradient), its value per layer: an input of the
    programs, each layer's own (DeepSeek-V3's router bias)."""

    def __init__(self, scale: float = 0.5):
        super().__init__()
        self.register_buffer("scale", torch.full((6,), scale))

    def forward(self, h):
        return h + self.lin(h) * self.scale


class WritesBuffer(WithBuffer):
    """Writes into its buffer (adding 0, so that every engine computes the same): a program
    would write into whatever buffer it is next given."""

    def forward(self, h):
        self.scale.add_(0)
        return h + self.lin(h) * self.scale


class AssignsBuffer(WithBuffer):
    """Replaces its buffer each call (by an equal one, as above): a program would not."""

    def forward(self, h):
        self.scale = self.scale * 1.0
        return h + self.lin(h) * self.scale


class InPlace(Lin):
    """Writes into an extra it is given (a count of the layers run): autograd allows it, a
    program would replay it on whatever it is next called with."""

    def forward(self, h, count):
        count.add_(1)
        return h + torch.tanh(self.lin(h))


class IntoConstant(Lin):
    """Writes part of h into a tensor it makes, which the backward reads: the write belongs
    to the forward (only a constant the forward never touches is made again in backward)."""

    def forward(self, h):
        m = torch.zeros(h.shape)
        m[..., 0] = h[..., 1] * 2
        return h + torch.tanh(self.lin(h)) * m


class ScalarIntoView(Lin):
    """A Python number written through a view: the trace holds it as a tensor attribute."""

    def forward(self, h):
        m = torch.ones(h.shape[-1])
        m[0] = 3.0
        return h + self.lin(h) * m


def _pre_count(m, b):
    return m.emb(b[0]), torch.zeros(())


class Indexed(Lin):
    """Layers that differ by a Python attribute their code reads: each is traced on its own."""

    def __init__(self, index):
        super().__init__()
        self.index = index

    def forward(self, h):
        return h + self.lin(h) / (1 + self.index)


class Tagged(Lin):
    """Layers that differ by an attribute their code does not read (HF's ``layer_idx``, used
    only by a KV cache): traced per layer, their graphs alike, so they share programs."""

    def __init__(self, tag):
        super().__init__()
        self.tag = tag


class Typed(Lin):
    """Layers that differ in a float their code only type-checks: hiding it must not pass."""

    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, h):
        if isinstance(self.w, float):
            h = h * self.w
        return h + self.lin(h)


class Flagged(Lin):
    """Layers that differ in a flag tested by identity (never hidden: ``is`` cannot refuse)."""

    def __init__(self, flag):
        super().__init__()
        self.flag = flag

    def forward(self, h):
        return h + (self.lin(h) if self.flag is True else torch.tanh(self.lin(h)))


class Scaled(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.s = s

    def forward(self, h):
        return h * self.s


class Optional(Lin):
    """Layers whose submodules differ (stochastic depth's ``DropPath(p) if p else Identity()``):
    a varying value that some layers do not hold at all."""

    def __init__(self, s):
        super().__init__()
        self.extra = Scaled(s) if s else nn.Identity()

    def forward(self, h):
        return h + self.extra(self.lin(h))


def _hooked():
    layer = Lin()
    layer.register_forward_hook(lambda m, args, out: out * 2)
    return layer


def fallback_ranks(rank, world):
    g = torch.Generator().manual_seed(0)
    b = (torch.randint(0, 11, (2, 5), generator=g), torch.randint(0, 11, (2, 5), generator=g))
    cases = {
        "reads": ([ReadsHost() for _ in range(3)], r"layer layers\.0 cannot be traced: .*"),
        "buffer": ([WithBuffer(s) for s in (0.5, -1.0, 2.0)], None),
        "writes a buffer": ([WritesBuffer() for _ in range(3)],
                            r"it writes into its input in place \(aten\.add_"),
        "assigns a buffer": ([AssignsBuffer() for _ in range(3)], r"it assigns its buffer scale"),
        "hook": ([_hooked() for _ in range(3)], r"has hooks \(_forward_hooks\)"),
        "indexed": ([Indexed(i) for i in range(3)], None),
        "tagged": ([Tagged(i) for i in range(3)], None),
        "into a constant": ([IntoConstant() for _ in range(3)], None),
        "scalar into a view": ([ScalarIntoView() for _ in range(3)],
                               r"layers\.0 cannot be traced: it makes a tensor from Python "
                               r"values \(torch\.tensor\(\.\.\.\), or a number written through a view"),
        "plain": ([Lin() for _ in range(3)], None),
        "typed": ([Typed(w) for w in (2.0, 3.0, 4.0)], None),
        "flagged": ([Flagged(f) for f in (True, False, True)], None),
        "optional": ([Optional(s) for s in (0, 0.5, 0.7)], None),
    }
    for name, (layers, why) in cases.items():
        torch.manual_seed(0)
        model, params = fz3.shard(LayerNet(layers), "layers", layer_pre, layer_post)
        for policy in (fz3.Policy(), fz3.Policy(activations="save")):
            step = fz3.value_and_grad(model, policy)
            loss, grads = step(params, b)
            want_loss, want = fz3.value_and_grad(model, policy, trace=False)(params, b)
            assert torch.equal(loss, want_loss) and _same(grads, want), (name, policy)
            failed = step.traced.failed.get("layers")
            if why is None:
                assert failed is None, (name, failed)
            else:
                assert failed is not None and re.search(why, failed), (name, failed)
        programs = {id(p) for p in model.traces.values() if isinstance(p, joint.Programs)}
        traces = [k for k in model.traces if k[0] != "joint"]  # one per trace made
        if name == "indexed":  # its trace reads the index: traced per layer (after one try
            # with the index hidden); their code differs, so do their programs
            assert step.traced.groups[model.part_index("layers")].own == [0, 1, 2]
            assert len(programs) == 3 and len(traces) == 4, (programs, traces)
        if name == "tagged":  # two traces for all three: the tag hidden, and layer 0's own
            assert step.traced.groups[model.part_index("layers")].own == [0, 1, 2]
            assert step.traced.groups[model.part_index("layers")].alike == [0, 0, 0]
            assert len(programs) == 1 and len(traces) == 2, (programs, traces)
        if name == "buffer":  # one program for all three, each layer's own buffer its input
            assert len(programs) == 1, programs
        if name == "plain":
            assert step.traced.groups[model.part_index("layers")].own == [0, 0, 0]
    # one step function, h of two shapes: traced once per shape, each step equal
    model, params = fz3.shard(LayerNet([Lin() for _ in range(3)]), "layers", layer_pre, layer_post)
    step = fz3.value_and_grad(model)
    for seq in (5, 3, 5):
        bb = (torch.randint(0, 11, (2, seq), generator=g), torch.randint(0, 11, (2, seq), generator=g))
        loss, grads = step(params, bb)
        want_loss, want = fz3.value_and_grad(model, trace=False)(params, bb)
        assert torch.equal(loss, want_loss) and _same(grads, want), seq
    assert len({id(p) for p in model.traces.values()}) == 2  # programs, one per shape
    torch.manual_seed(0)
    model, params = fz3.shard(LayerNet([InPlace() for _ in range(3)]), "layers", _pre_count, layer_post)
    step = fz3.value_and_grad(model)
    loss, grads = step(params, b)
    want_loss, want = fz3.value_and_grad(model, trace=False)(params, b)
    assert torch.equal(loss, want_loss) and _same(grads, want)
    assert re.search(r"writes into its input in place \(aten\.add_", step.traced.failed["layers"])
    return "ok"


def test_layers_that_cannot_be_traced_run_through_autograd():
    assert dist.run(1, fallback_ranks, timeout=300) == ["ok"]


def test_python_bindings_only_where_they_dispatch_the_same_op():
    """``fast_ops``: an op is called through its Python binding (``torch.mm``) only if a trace
    of the program shows the very same ATen op and arguments; ``torch.mul(h, 2.0)`` dispatches
    ``mul.Tensor``, so a graph's ``mul.Scalar`` stays on ``_op``."""
    from fz3.step import codegen, joint

    w = torch.randn(4, 4)

    def layer(row, frozen_row, h):
        return torch.ops.aten.mul.Scalar(h @ row.view(4, 4), 2.0) + h

    programs = joint.trace(layer, [w.reshape(-1), torch.randn(3, 4)], False, [])
    forward, backward = programs.graphs[:2]
    assert codegen.fast_ops(forward) == {torch.ops.aten.mul.Scalar}
    assert torch.ops.aten.mul.Scalar in codegen.fast_ops(backward, boxed=True)
    h, g = torch.randn(3, 4), torch.randn(3, 4)
    out, *residuals = programs.forward(w.reshape(-1), h)
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = layer(wl.reshape(-1), None, hl)
    want.backward(g)
    grad_row, grad_h = programs.backward([w.reshape(-1), *residuals, g])
    assert torch.equal(out, want) and torch.equal(grad_h, hl.grad)
    assert torch.equal(grad_row, wl.grad.reshape(-1))


def test_a_rows_parameter_views_are_made_once_per_keeper():
    """``codegen.RowViews``: a layer's forward, inference and backward share one maker of their
    row's parameter views; given a row's ``made`` (its unit's memory holds one per row), it
    makes the views at the first call, keeps them there and hands the same ones back; with
    none (a trace's row) it makes them each call. Every result is eager autograd's, bit for
    bit."""
    from fz3.step import codegen, joint

    def layer(row, frozen_row, h):
        weight, bias = row.split([16, 4])
        return torch.tanh(h @ weight.view(4, 4) + bias)

    def makers(fn):
        return [v for v in fn.__globals__.values() if isinstance(v, codegen.RowViews)]

    def eager(row, h, g):
        rl, hl = row.clone().requires_grad_(), h.clone().requires_grad_()
        out = layer(rl, None, hl)
        out.backward(g)
        return out, rl.grad, hl.grad

    h, g = torch.randn(3, 4), torch.randn(3, 4)
    programs = joint.trace(layer, [torch.randn(20), h], False, [])
    (maker,) = makers(programs.forward)
    assert makers(programs.backward) == makers(programs.inference) == [maker]
    for _ in range(3):  # a new row each time
        row, made = torch.randn(20), {}
        out, *residuals = programs.forward(row, h, made=made)
        (again,) = programs.inference(row, h, made=made)
        views = made[maker]
        grad_row, grad_h = programs.backward([row, *residuals, g], made=made)
        assert maker(row, made) is views and list(made) == [maker]
        assert maker(row) is not views
        want = eager(row, h, g)
        for got, expected in zip((out, again, grad_row, grad_h), (want[0], *want)):
            assert torch.equal(got, expected)


def _aten_ops(fn, *args):
    """The ATen ops ``fn(*args)`` dispatches, by name, and its result."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        out = fn(*args)
    return ops.names, out


def test_recompute_runs_forward_and_backward_as_one_program():
    """``Programs.recompute``: a layer's forward and backward joined in one program, bit for bit
    what the two give and eager autograd's, without the ops only the layer's output needed
    (``sin``: its derivative reads its input, not its output). A weight's ``t`` is made with
    the row's views (``RowViews.derive``): once per row, not per program call."""
    from fz3.step import codegen, joint

    def layer(row, frozen_row, h):
        weight, bias = row.split([16, 4])
        return torch.sin(torch.nn.functional.linear(h, weight.view(4, 4), bias))

    h, g, row = torch.randn(3, 4), torch.randn(3, 4), torch.randn(20)
    programs = joint.trace(layer, [row, h], False, [])
    (maker,) = [v for v in programs.recompute.__globals__.values()
                if isinstance(v, codegen.RowViews)]
    assert [op.__name__ for _, op, _ in maker.derived] == ["t"], maker.derived
    made = {}  # the row's views, kept (as its unit's memory keeps them)
    _, residuals = _aten_ops(lambda *a: programs.forward(*a, made=made), row, h)
    split, (grad_row, grad_h) = _aten_ops(lambda b: programs.backward(b, made=made),
                                          [row, *residuals[1:], g])
    joined, (got_row, got_h) = _aten_ops(lambda b: programs.recompute(b, made=made), [row, h, g])
    rl, hl = row.clone().requires_grad_(), h.clone().requires_grad_()
    layer(rl, None, hl).backward(g)
    for got, want in ((got_row, grad_row), (got_h, grad_h), (got_row, rl.grad),
                      (got_h, hl.grad)):
        assert torch.equal(got, want)
    forward = _aten_ops(lambda *a: programs.forward(*a, made=made), row, h)[0]
    assert "sin" in forward and "sin" not in joined, joined
    # the weight's t comes with the row's views (made: a hit); the backward's own t of its
    # gradient is run
    assert "t" not in forward and joined.count("t") == split.count("t") == 1, (joined, split)
    assert len(joined) < len(forward) + len(split), (joined, forward, split)


# A layer that writes into its input (issue 23): plain PyTorch allows it (h is the previous
# layer's output there); fz3 keeps a unit's input to recompute from, or differentiates it as a
# leaf, so such a layer is given a copy. Reference: plain autograd on the unsharded module.


class Halves(Lin):
    def forward(self, h):
        h.mul_(0.5)
        return h + torch.tanh(self.lin(h))


class ThroughAView(Lin):
    """Writes through a view of its input, after reading it (by an op that keeps nothing: in
    plain PyTorch too a write into a tensor autograd saved fails its backward)."""

    def forward(self, h):
        total = h.sum(-1, keepdim=True)
        h[..., :2] *= 2
        return h + torch.tanh(self.lin(h)) + total


class NormalisesInPlace(Lin):
    """An MoE router's pattern: the top-k of a softmax normalised in place, whose derivative
    needs the values before the write (autograd copies them before it: the traced forward must
    too, not its backward, which would read the normalised ones)."""

    def forward(self, h):
        top, _ = torch.topk(torch.softmax(self.lin(h), -1), 3, dim=-1)
        top /= top.sum(-1, keepdim=True)
        return h + torch.tanh(h) * top.sum(-1, keepdim=True) + top[..., :1] * h


class Later(Lin):
    """Writes into its input after its first ``calls`` calls (counted in a list it appends
    to: state no trace or first call can see)."""

    def __init__(self, calls):
        super().__init__()
        self.calls, self.after = [], calls

    def forward(self, h):
        self.calls.append(1)
        if len(self.calls) > self.after:
            h.mul_(2)
        return h + self.lin(h)


def writes_input_ranks(rank, world):
    g = torch.Generator().manual_seed(0)
    bs = [(torch.randint(0, 11, (2, 5), generator=g), torch.randint(0, 11, (2, 5), generator=g))
          for _ in range(world)]
    policies = (fz3.Policy(), fz3.Policy(activations="save"), fz3.Policy(layers_per_unit=2),
                fz3.Policy(activations="save", layers_per_unit=2))
    for kind in (Halves, ThroughAView, NormalisesInPlace):
        torch.manual_seed(0)
        net = LayerNet([kind() for _ in range(4)])
        want_loss, want = layer_net_plain(net, concat(bs))
        model, params = fz3.shard(net, "layers", layer_pre, layer_post)
        for policy in policies:
            for trace in (True, False):
                what = (kind.__name__, trace, str(policy))
                step = fz3.value_and_grad(model, policy, trace=trace)
                for _ in range(2):  # the first call learns it writes, the second knows
                    loss, grads = step(params, bs[rank])
                    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
                    full = fz3.full_state_dict(model, grads)  # collective; rank 0 gets it
                    if full is not None:
                        assert_close(full, want, what=str(what))
                if trace:  # traced: its program writes into a copy of h, made in the forward
                    assert step.traced.failed == {}, (what, step.traced.failed)
                    traced_loss, traced_grads = loss, grads
                else:  # the same ops, bit for bit
                    assert torch.equal(loss, traced_loss) and _same(grads, traced_grads), what
        for trace in (True, False):  # forward only (no grad): the mean of the ranks' losses
            got = fz3.apply(model.eval(), params, bs[rank], trace=trace)
            torch.testing.assert_close(got, want_loss, rtol=1e-5, atol=1e-6)
    # a layer that starts writing on a later call is named, not silently wrong: in a forward
    # without gradient (recompute's, whose backward calls each layer again) and with one
    for calls, policy in ((2, fz3.Policy()), (1, fz3.Policy(activations="save"))):
        model, params = fz3.shard(LayerNet([Later(calls) for _ in range(2)]), "layers",
                                  layer_pre, layer_post)
        step = fz3.value_and_grad(model, policy, trace=False)
        step(params, bs[rank])
        with pytest.raises(RuntimeError, match=r"layers\.0 wrote into its input h in place on "
                                               r"this call, but not on its first"):
            step(params, bs[rank])
    return "ok"


class TimeMajorOut(nn.Module):
    """Hands h on laid out time-major (its transpose's memory): the next layer of its unit
    gets an input of other strides than the unit's, which its programs were traced for."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, h):
        z = torch.tanh(self.lin(h.reshape(-1, 6))).view(h.shape)  # a view of h as traced
        return (h + z).transpose(0, 1).contiguous().transpose(0, 1)


def layouts_ranks(rank, world):
    """Inputs laid out otherwise than their programs were traced for, each of which failed
    in the programs' views ("view size is not compatible"): a loss reading h time-major hands
    the last layer a transposed gradient; a pre handing on a transposed h gives the programs
    one; a layer handing on a time-major h gives the next layer of its unit another input
    layout than the unit's. Each is copied into the traced layout first ([Note: inputs in
    their traced layout]). Against plain autograd (the tolerance: the module docstring)."""
    g = torch.Generator().manual_seed(0)
    bs = [(torch.randint(0, 11, (2, 5), generator=g), torch.randint(0, 11, (2, 5), generator=g))
          for _ in range(world)]
    for kind, pre, post in ((Lin, layer_pre, time_major_post), (Lin, time_major_pre, layer_post),
                            (Lin, time_major_pre, time_major_post),
                            (TimeMajorOut, layer_pre, layer_post)):
        torch.manual_seed(0)
        net = LayerNet([kind() for _ in range(4)])
        want_loss, want = layer_net_plain(net, concat(bs), pre, post)
        model, params = fz3.shard(net, "layers", pre, post)
        for policy in (fz3.Policy(), fz3.Policy(layers_per_unit=2),
                       fz3.Policy(activations="save", layers_per_unit=2)):
            what = (kind.__name__, pre.__name__, post.__name__, str(policy))
            # the plan runs the programs on its own cotangent (traced here, kept for the step)
            assert fz3.memory_plan(model, fz3.plan(model, policy), bs[rank]).peak > 0
            step = fz3.value_and_grad(model, policy)
            for _ in range(2):
                loss, grads = step(params, bs[rank])
                torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
                full = fz3.full_state_dict(model, grads)  # collective; rank 0 gets it
                if full is not None:
                    assert_close(full, want, what=str(what))
            assert step.traced.failed == {}, (what, step.traced.failed)
    return "ok"


def test_gradients_of_any_layout_reach_the_programs_as_traced():
    assert dist.run(2, layouts_ranks, timeout=300) == ["ok"] * 2


def test_a_layer_writing_into_its_input_gives_plain_pytorchs_results():
    assert dist.run(2, writes_input_ranks, timeout=300) == ["ok"] * 2


def test_a_failing_fake_kernel_prints_no_traceback(caplog):
    """A layer whose fake kernel refuses its inputs (``_grouped_mm`` in bf16 with rows of 6
    bytes, which its fake kernel's 16-byte alignment rule refuses; in fp32 it is traced,
    ``fz3.step.fake_kernels``): the trace fails with a one-line reason, and torch's
    fake-tensor logger prints no traceback (issue 30: ~30 lines of ERROR per rank for a
    harmless fallback)."""

    def layer(row, frozen_row, h):
        offs = torch.tensor([2, 4], dtype=torch.int32)
        return h + torch._grouped_mm(h, row[:18].view(2, 3, 3), offs=offs)

    bf16 = dict(dtype=torch.bfloat16)
    with caplog.at_level(logging.DEBUG), \
            pytest.raises(joint.TraceError, match=r"^RuntimeError: Expected mat_a stride along 0 "
                                                  r"dim to be multiple of 16 bytes"):
        joint.trace(layer, [torch.randn(64, **bf16), torch.randn(4, 3, **bf16)], False, [])
    printed = [r for r in caplog.records if r.name.startswith("torch._subclasses")]
    assert not printed, [r.getMessage()[:200] for r in printed]
    assert logging.getLogger("torch._subclasses.fake_tensor").level == logging.NOTSET


def new_shape_ranks(rank, world):
    """A batch of another shape than the programs were traced for: the layers are traced
    again for it, said once at INFO (naming the new and the earlier shapes), and its step is
    still bit for bit the untraced one; that shape again, the first one again, or the same
    shape in eval mode, say nothing."""
    from reference import fz3_said

    model, params = shard_gpt(gpt(CFG))
    long, short = batches(CFG, world)[rank], batches(dataclasses.replace(CFG, seq=5), world)[rank]
    policy = fz3.Policy(activations="save")
    step = fz3.value_and_grad(model, policy)
    with fz3_said() as said:
        step(params, long)
        quiet = list(said)
        torch.manual_seed(3)
        loss, grads = step(params, short)
        told = list(said)
        step(params, short)
        step(params, long)
        fz3.apply(model.eval(), params, short)
    torch.manual_seed(3)
    want_loss, want = fz3.value_and_grad(model, policy, trace=False)(params, short)
    assert torch.equal(loss, want_loss) and _same(grads, want)
    assert not [m for m in quiet if "another shape" in m], quiet
    new = [m for m in told if "another shape" in m]
    assert len(new) == 1 and "h [2, 5, 16]" in new[0] and "1 before, the last [2, 8, 16]" in \
        new[0], told
    assert [m for m in said if "another shape" in m] == new, said
    return "ok"


def test_a_batch_of_another_shape_is_traced_again_and_said_once():
    assert dist.run(1, new_shape_ranks) == ["ok"]


def test_programs_run_below_autograd():
    """[Note: programs run below autograd] (``fz3.step.programs``): ``Layers`` runs its programs
    with autograd's dispatch keys skipped, so the views they make carry no autograd metadata
    (making it cost ``save`` ~13% of its host time a layer). Called directly, above autograd,
    the same program's residuals include an autograd view (so this can fail); the results are
    the same bit for bit either way."""
    from fz3.step.engine import Pieces, Produced
    from fz3.step.programs import Extras, Layers

    def layer(row, frozen_row, h):
        weight, bias = row.split([16, 4])
        x = torch.tanh(h @ weight.view(4, 4) + bias).view(12, 1)
        return (x * x).view(3, 4)  # the product saves x, a view

    h, g = torch.randn(3, 4), torch.randn(3, 4)
    programs = joint.trace(layer, [torch.randn(20), h], False, [])
    row, other = torch.randn(20), torch.randn(20)  # apart (no views kept: no ``made``)
    out, *residuals = programs.forward(other.copy_(row), h)
    assert any(r._is_view() for r in residuals)  # above autograd
    grad_row, grad_h = programs.backward([other, *residuals, g])
    layers = Layers((programs,), buffers=((),))
    extras = Produced((), [], traced=Extras((), [], (), (), 0))
    memory = SimpleNamespace(pieces=Pieces(row.view(1, -1), (row,), None, made=({},)),
                             grad_into=lambda: None)  # (no gradient memory: a new tensor)
    (got,), kept = layers.forward(memory, (h, extras))
    assert not any(r._is_view() for r in kept[0])
    (got_row,), (got_h, summed) = layers.backward(memory, kept, (g,))
    assert summed == [] and torch.equal(got, out) and torch.equal(got_h, grad_h)
    assert torch.equal(got_row.view(-1), grad_row)


def test_live_bytes_counts_no_views_made_below_autograd():
    """``LiveBytes(writes=True)`` counts an op's output that aliases an input as written (a
    collective's), but not a view op's, nor that of an op made of other ops, which it sees
    whole below autograd: a row's parameter views (``unflatten_dense_tensors``) own nothing.
    Counted, they put a two-layer unit's row on the live peak at one rank
    (``tests/test_units.py``' plan-vs-live test failed so)."""
    from fz3.observe.live_bytes import LiveBytes
    from fz3.step.programs import below_autograd

    row, shapes = torch.ones(20), [torch.empty(4, 4), torch.empty(4)]
    with LiveBytes(writes=True) as live, below_autograd():
        views = torch._C._nn.unflatten_dense_tensors(row, shapes)
        views[0].t()
    assert live.peak == 0
    with LiveBytes(writes=True) as live, below_autograd():
        flat = torch._C._nn.flatten_dense_tensors(list(views))  # a copy: counted
    assert live.peak == flat.numel() * flat.element_size() == 80
