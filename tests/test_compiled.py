"""Compiled layers (``compile=True``): a stack's traced programs (``fz3.step.traced``) compiled
once by inductor serve every layer (on the CPU its C++ backend); a layer that cannot be traced
runs through autograd, with a warning; a program inductor fails on runs as Python with a
warning, or raises ``fz3.CompileError`` with ``strict``. Selective recompute's programs are
compiled like the others.

Reference: plain PyTorch autograd on the unsharded GPT over the concatenated batch. Tolerance
rtol 1e-4 / atol 1e-5 instead of fp32's 1e-5 / 1e-6: inductor fuses kernels and sums
layer norms' and softmax's reductions in another order than eager ATen (PyTorch's own
inductor tests compare fp32 at 1e-4). Measured here: 4e-7 relative. Models are tiny: a
compile costs seconds on these 2 cores, and inductor's cache makes the next ones cheap."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import dist
import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from fz3.step.inductor import Kernels
from reference import (LayerNet, assert_close, batches, fz3_said, gpt, layer_net_plain, layer_post, layer_pre,
                       reference_grads, time_major_post, time_major_pre)

CFG = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2)
RTOL, ATOL = 1e-4, 1e-5  # compiled kernels reorder fp32 sums (see the module docstring)


def compiled_ranks(rank, world):
    compiles = {}
    for layers in (2, 6):
        cfg = GPTConfig(**{**CFG.__dict__, "layers": layers})
        module = gpt(cfg)
        model, params = shard_gpt(module)
        bs = batches(cfg, world)
        ref_loss, ref = reference_grads(module, bs)
        before, counts = counters["stats"]["unique_graphs"], []
        for policy in (fz3.Policy(), fz3.Policy(activations="save", layers_per_unit=2),
                       fz3.Policy(activations="selective")):
            with fz3_said(logging.WARNING) as said:  # no fallback, no recompile warning
                step = fz3.value_and_grad(model, policy, compile=True)
                loss, grads = step(params, bs[rank])
                loss, grads = step(params, bs[rank])  # a second call: nothing new to compile
            assert not said, said
            torch.testing.assert_close(loss.item(), ref_loss, rtol=RTOL, atol=ATOL)
            got = fz3.full_state_dict(model, grads)
            if rank == 0:
                assert_close(got, ref, rtol=RTOL, atol=ATOL, what=f"compiled {policy} layers={layers}")
            counts.append(step.traced.compiles)
        fwd = fz3.apply(model, params, bs[rank], compile=step)
        torch.testing.assert_close(fwd.item(), ref_loss, rtol=RTOL, atol=ATOL)
        counts.append(step.traced.compiles)
        assert step.traced.failed == {}, step.traced.failed
        # traced layers go to inductor directly: dynamo compiled nothing
        assert counters["stats"]["unique_graphs"] == before, counters["stats"]
        compiles[layers] = counts
    # each step compiled each program once for all its layers: recompute its inference
    # (forward without gradient) and recompute (forward and backward joined) programs; save
    # its forward and backward; selective its own forward and backward; then apply the
    # inference program on it; at 2 layers as at 6 (recompute compiled its forward and
    # backward too, 3, before Programs.recompute)
    assert compiles[2] == compiles[6] == [2, 2, 2, 3], compiles
    return "ok"


def test_compiled_layers_equal_plain_and_compile_once():
    assert dist.run(2, compiled_ranks, timeout=400) == ["ok"] * 2


class Breaks(nn.Module):
    """A layer dynamo cannot trace whole: it reads a tensor's value on the host."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h):
        return h + self.lin(h) * float(h.abs().max() > 0)


class Indexed(nn.Module):
    """Layers that differ by a Python attribute their code reads: each compiles on its own."""

    def __init__(self, d, index):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.index = index

    def forward(self, h):
        return h + self.lin(h) / (1 + self.index)


class Act(nn.Module):
    """Layers that differ by the function they apply: programs alike but for one op, which
    must not share a compilation."""

    def __init__(self, d, act):
        super().__init__()
        self.lin, self.act = nn.Linear(d, d), act

    def forward(self, h):
        return h + self.act(self.lin(h))


def _numpy(x):
    """Fails under fake tensors: inductor cannot compile a graph that calls it."""
    return torch.from_numpy(x.detach().numpy())


def _one(said: list[str], pattern: str) -> None:
    """One WARNING (a logging line, not warnings.warn), and it reads ``pattern``."""
    assert len(said) == 1 and re.match(pattern, said[0]), said


def fallback_ranks(rank, world):
    g = torch.Generator().manual_seed(0)
    b = (torch.randint(0, 11, (2, 5), generator=g), torch.randint(0, 11, (2, 5), generator=g))
    torch.manual_seed(0)
    model, params = fz3.shard(LayerNet([Breaks(6) for _ in range(3)]), "layers", layer_pre, layer_post)
    want, _ = fz3.value_and_grad(model)(params, b)
    with fz3_said(logging.WARNING) as said:
        loss, _ = fz3.value_and_grad(model, compile=True)(params, b)
    _one(said, r"fz3: layer layers\.0 cannot be traced: .*; its layers run through autograd, "
               r"not compiled")
    assert torch.equal(loss, want)  # autograd both ways: the same bits
    # strict=True: compiled or an error, naming the layer and why, in a few lines
    with pytest.raises(fz3.CompileError, match=r"compile=True, strict=True, but layer layers\.0 "
                                               r"cannot be traced: .*pass strict=False") as error:
        fz3.value_and_grad(model, compile=True, strict=True)(params, b)
    assert len(str(error.value).splitlines()) <= 30
    net = LayerNet([Act(6, torch.tanh) for _ in range(2)])
    net.layers[1].register_forward_hook(lambda *a: None)  # a hook: refused before any step
    hooked, _ = fz3.shard(net, "layers", layer_pre, layer_post)
    with pytest.raises(fz3.CompileError, match=r"strict=True, but layer layers\.1 cannot be traced"):
        fz3.value_and_grad(hooked, compile=True, strict=True)
    torch.manual_seed(0)
    indexed, iparams = fz3.shard(LayerNet([Indexed(6, i) for i in range(3)]), "layers", layer_pre, layer_post)
    want, _ = fz3.value_and_grad(indexed)(iparams, b)
    with fz3_said(logging.WARNING) as said:
        loss, _ = fz3.value_and_grad(indexed, compile=True)(iparams, b)
    _one(said, r"fz3: the compiled layer function of layers compiled again at layer layers\.1: "
               r"something its code reads differs per layer")
    torch.testing.assert_close(loss, want, rtol=RTOL, atol=ATOL)
    torch.manual_seed(0)
    acts, aparams = fz3.shard(LayerNet([Act(6, f) for f in (torch.tanh, torch.sigmoid, torch.tanh)]),
                              "layers", layer_pre, layer_post)
    want, _ = fz3.value_and_grad(acts)(aparams, b)
    with fz3_said(logging.WARNING) as said:
        step = fz3.value_and_grad(acts, compile=True)
        loss, _ = step(aparams, b)
    _one(said, r".*compiled again at layer layers\.1")
    torch.testing.assert_close(loss, want, rtol=RTOL, atol=ATOL)
    # recompute (the default policy) compiles inference and recompute (forward and backward
    # joined) of tanh's and of sigmoid's (6, forward and backward apart, before
    # Programs.recompute)
    assert step.traced.compiles == 4
    # a program inductor cannot compile: Python with a warning, or CompileError with strict
    from torch import fx

    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(3)
    graph.output((graph.call_function(_numpy, (x,)),))
    python = lambda t: (t * 1,)  # noqa: E731 - the program as Python
    lenient = Kernels()
    with fz3_said(logging.WARNING) as said:
        assert lenient.kernel(graph, (torch.ones(3),), python, "layer layers.0 (layers)'s "
                              "forward") is python
    _one(said, r"fz3: inductor cannot compile layer layers\.0 \(layers\)'s forward traced program: "
               r".*; it runs as Python \(strict=True raises\)")
    with pytest.raises(fz3.CompileError) as error:
        Kernels(strict=True).kernel(
            graph, (torch.ones(3),), python, "layer layers.0 (layers)'s forward")
    # one line for people: which program, why, the fix; inductor's whole text as the cause
    message = str(error.value)
    assert "\n" not in message and re.fullmatch(
        r"fz3: inductor cannot compile layer layers\.0 \(layers\)'s forward traced program: "
        r"\w+: .{1,200}\. Pass compile=False, or strict=False to run it as Python", message), message
    assert error.value.__cause__ is not None
    with pytest.raises(NotImplementedError, match=r"cuda_graphs=True: capturing the layers as CUDA "
                                                  r"graphs awaits a GPU measurement"):
        fz3.value_and_grad(model, cuda_graphs=True)
    with pytest.raises(ValueError, match=r"strict=True asks compile=True to raise"):
        fz3.value_and_grad(model, strict=True)
    with pytest.raises(ValueError, match=r"compile=True compiles the traced layer programs: pass "
                                         r"trace=True"):
        fz3.value_and_grad(model, compile=True, trace=False)
    return "ok"


def test_fallback_strict_and_recompiles_are_reported():
    assert dist.run(1, fallback_ranks, timeout=300) == ["ok"]


def unread_random_ranks(rank, world):
    """``Kernels.compiled``: inductor drops a random draw that nothing reads, so a joined
    graph with one (noise only the layer's output needed) gets no compiled recompute program
    and runs forward, then backward; otherwise every later draw would shift and the gradient
    be of other dropout masks than the loss's. Where every draw is read, the compiled
    recompute draws what the compiled forward does, bit for bit."""
    import torch.nn.functional as F

    from fz3.step import joint
    from fz3.step.inductor import Kernels

    def read(row, frozen_row, h):
        w, b = row.split([16, 4])
        a = h * (1 + 0.1 * torch.randn_like(h))  # the gradient reads this noise
        return a + F.dropout(torch.tanh(F.linear(h, w.view(4, 4), b)), 0.5, True)

    def unread(row, frozen_row, h):
        w, b = row.split([16, 4])
        y = h + F.dropout(torch.tanh(F.linear(h, w.view(4, 4), b)), 0.5, True)
        return y + 0.1 * torch.randn_like(h)  # only the output reads it

    row, h = torch.randn(20), torch.randn(64, 4)
    traced = {layer: joint.trace(layer, [row, h], False, []) for layer in (read, unread)}
    assert Kernels(strict=True).compiled(traced[unread], "unread").recompute is None
    assert traced[unread].recompute is not None  # Python runs the unread draw: it keeps it
    compiled = Kernels(strict=True).compiled(traced[read], "read")
    g = torch.randn_like(h)
    torch.manual_seed(0)
    out = compiled.forward(row, h)
    want = compiled.backward([row, *out[1:], g])
    torch.manual_seed(0)
    got = compiled.recompute([row, h, g])
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    return "ok"


def test_a_random_draw_nothing_reads_keeps_the_compiled_recompute_apart():
    assert dist.run(1, unread_random_ranks, timeout=300) == ["ok"]


class TanhAux(nn.Module):
    """A layer returning (h, aux): its output (contiguous, whatever its input's layout) and
    that output's mean over batch and time, per feature."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, h):
        out = (h + torch.tanh(self.lin(h))).contiguous()
        return out, out.mean(dim=(0, 1))


def time_major_aux_post(m, h, b, aux):
    """``time_major_post`` plus a term reading the stack's aux (layers, 6) transposed: both
    cotangents the layers get are transposed views."""
    (stacked,) = aux  # one per stack
    return time_major_post(m, h, b) + 0.1 * (stacked.t()[:3] ** 2).sum()


def layouts_ranks(rank, world):
    """Compiled programs check their inputs' strides: a pre handing on a transposed h (so the
    unit's later layers get contiguous inputs, its first a transposed one), and a loss whose
    gradients w.r.t. h and the layers' aux outputs are transposed views, still meet the
    layouts the programs were traced and compiled for ([Note: inputs in their traced
    layout], ``fz3.step.programs``), where they raised inductor's stride assertion."""
    g = torch.Generator().manual_seed(0)
    b = (torch.randint(0, 11, (2, 5), generator=g), torch.randint(0, 11, (2, 5), generator=g))
    torch.manual_seed(0)
    net = LayerNet([TanhAux() for _ in range(3)])
    want_loss, want = layer_net_plain(net, b, time_major_pre, time_major_aux_post, aux=True)
    model, params = fz3.shard(net, "layers", time_major_pre, time_major_aux_post,
                              layer_aux=True)
    # save, one unit of the three layers: one signature, two programs to compile (recompute's
    # joined program takes g the same way; tests/test_traced.py runs both policies traced)
    step = fz3.value_and_grad(model, fz3.Policy(activations="save", layers_per_unit=3),
                              compile=True, strict=True)
    for _ in range(2):
        loss, grads = step(params, b)
        torch.testing.assert_close(loss, want_loss, rtol=RTOL, atol=ATOL)
        assert_close(fz3.full_state_dict(model, grads), want, rtol=RTOL, atol=ATOL)
    assert step.traced.failed == {} and step.traced.compiles == 2, step.traced.failed
    return "ok"


def test_compiled_programs_meet_gradients_of_any_layout():
    assert dist.run(1, layouts_ranks, timeout=300) == ["ok"]
