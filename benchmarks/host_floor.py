"""The floor under a per-layer executor's host time, without fz3: what PyTorch itself charges
for running a stack one layer at a time.

    python benchmarks/host_floor.py        # ~20 s on one core

The host-overhead proxy's GPT block (hidden 16, seq 8, batch 1: compute negligible), 48
layers, one thread, forward+backward, microseconds per layer (median of 30 steps):

- plain: one forward over the stack, one ``backward()``.
- per-layer grad: each layer's input a fresh leaf, one ``torch.autograd.grad`` per layer in
  reverse (what any executor that acts between layers' backwards must do without hooks).
- + flat leaf: its parameters are views of one flat leaf buffer, substituted by
  ``torch.func.functional_call``, and the gradient comes out flat.
- + flat leaf, fz3's binding: the same, the views substituted by ``fz3.sharding.binding``
  (the name lookup done once per model), as fz3's layers run with ``trace=False``.
- flat row, traced programs: the layer traced once into a forward and a backward program
  (``fz3.step.joint``), called per layer without the autograd engine.
- + below autograd: the same programs with the dispatcher's autograd keys skipped
  (``fz3.step.programs.below_autograd``), as fz3's layers run by default.
- + inductor: those programs compiled by inductor (``fz3.step.inductor``), as with
  ``compile=True``: the floor under ``host_overhead.py``'s compiled rows.

fz3's own cost is what ``benchmarks/host_overhead.py`` measures beyond the below-autograd row
(beyond the inductor row, compiled). The compiled programs' gradient is checked against the
uncompiled one's before anything is timed.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.func import functional_call

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import systems  # noqa: E402

from fz3.models.gpt import Block, GPTConfig  # noqa: E402
from fz3.sharding.binding import Binding  # noqa: E402
from fz3.sharding.layout import FlatLayout  # noqa: E402
from fz3.step.inductor import Kernels  # noqa: E402
from fz3.step.joint import trace  # noqa: E402
from fz3.step.programs import below_autograd  # noqa: E402

LAYERS = 48


def per_layer_us(fn, steps: int = 30) -> float:
    return systems.median_time(fn, steps) / LAYERS * 1e6


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=32, seq=8, dim=16, heads=2)
    blocks = [Block(cfg) for _ in range(LAYERS)]
    x0 = torch.randn(1, cfg.seq, cfg.dim)
    named = list(blocks[0].named_parameters())
    names, shapes = [n for n, _ in named], [p.shape for _, p in named]
    sizes = [p.numel() for _, p in named]
    flats = [torch.cat([p.detach().reshape(-1) for p in b.parameters()]) for b in blocks]

    def plain():
        h = x0
        for b in blocks:
            h = b(h)
        h.sum().backward()

    def reverse(saved):
        g = torch.ones_like(saved[-1][1])
        for x, out, wrt in reversed(saved):
            g = torch.autograd.grad(out, [x, *wrt], g)[0]

    def per_layer_grad():
        saved, h = [], x0
        for b in blocks:
            x = h.detach().requires_grad_()
            h = b(x)
            saved.append((x, h, list(b.parameters())))
        reverse(saved)

    def flat_leaf():
        saved, h = [], x0
        for b, flat in zip(blocks, flats):
            leaf = flat.detach().requires_grad_()
            views = [v.view(s) for v, s in zip(torch.split(leaf, sizes), shapes)]
            x = h.detach().requires_grad_()
            h = functional_call(b, dict(zip(names, views)), (x,))
            saved.append((x, h, [leaf]))
        reverse(saved)

    layout = FlatLayout.build([((n,), p) for n, p in named], 1)
    bindings = [Binding(lambda m, h: m(h), b, [layout]) for b in blocks]

    def flat_leaf_bound():
        saved, h = [], x0
        for binding, flat in zip(bindings, flats):
            leaf = flat.detach().requires_grad_()
            x = h.detach().requires_grad_()
            h = binding(layout.views(leaf), (x,))
            saved.append((x, h, [leaf]))
        reverse(saved)

    def layer(row, frozen_row, h):
        return bindings[0](layout.views(row), (h,))

    programs = trace(layer, [flats[0], x0], False, [])

    def traced(run=programs):  # fz3's traced programs: no autograd engine
        residuals, h = [], x0
        for flat in flats:
            out = run.forward(flat, h)
            h = out[0]
            residuals.append(out[1:])
        g = torch.ones_like(h)
        for flat in reversed(flats):
            g = run.backward([flat, *residuals.pop(), g])[1]
        return g

    def below(run=programs):
        with below_autograd():
            return traced(run)

    compiled = Kernels(strict=True).compiled(programs, "the block")
    # inductor reorders float sums: equal to rounding, not bitwise
    torch.testing.assert_close(below(compiled), below(), rtol=1e-4, atol=1e-6)

    rows = [("plain", per_layer_us(plain)), ("per-layer grad", per_layer_us(per_layer_grad)),
            ("+ flat leaf", per_layer_us(flat_leaf)),
            ("+ flat leaf, fz3's binding", per_layer_us(flat_leaf_bound)),
            ("flat row, traced programs (no autograd)", per_layer_us(traced)),
            ("+ below autograd", per_layer_us(below)),
            ("+ inductor (compile=True)", per_layer_us(lambda: below(compiled)))]
    print(f"torch {torch.__version__}, {LAYERS} layers, hidden {cfg.dim}, seq {cfg.seq}, 1 thread")
    print("| run | us per layer | x plain |\n|---|---:|---:|")
    for name, us in rows:
        print(f"| {name} | {us:.0f} | {us / rows[0][1]:.2f} |")


if __name__ == "__main__":
    main()
