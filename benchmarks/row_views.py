"""What a gathered row's parameter views cost when they are made again, against keeping them.

    python benchmarks/row_views.py        # ~15 s on one core

A traced program reads a layer's parameters as views of its gathered row
(``fz3.step.views.RowViews``: one C++ call for a dozen views, then each weight's ``t``). A
gather into a new buffer every step makes them again; a step function keeps each unit's
buffer objects, their storage released at ``free`` and regrown by the next gather, and the
views of each row in a dict its memory holds (``fz3.step.memory``), and reuses them. Per gather, microseconds (median of
7 runs of 2000), for the GPT block of ``host_overhead.py`` (hidden 16) and wider ones:

- new: ``torch.empty`` of the row, its views made, both dropped;
- kept: ``resize_(0)`` and back of the same row's storage, its views found in its dict.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fz3.models.gpt import Block, GPTConfig  # noqa: E402
from fz3.step.views import RowViews  # noqa: E402


def per_call(fn, calls: int = 2000, runs: int = 7) -> float:
    for _ in range(200):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    for dim in (16, 64, 512):
        shapes = [tuple(p.shape) for p in Block(GPTConfig(dim=dim, heads=2)).parameters()]
        views = RowViews(shapes)
        for i, shape in enumerate(shapes):
            if len(shape) == 2:  # each weight's t, as the programs take it (``derive``)
                views.derive(i, torch.Tensor.t, ())
        numel = sum(torch.Size(s).numel() for s in shapes)
        kept, made = torch.empty(numel), {}

        def new():
            views(torch.empty(numel))

        def reuse():
            storage = kept.untyped_storage()
            storage.resize_(0)
            storage.resize_(numel * 4)
            views(kept, made)

        print(f"hidden {dim:4d}, row {numel * 4:>10,} B: new {per_call(new):5.1f} us, "
              f"kept {per_call(reuse):4.1f} us per gather")


if __name__ == "__main__":
    main()
