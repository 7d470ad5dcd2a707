"""Python calls into fz3's own functions per layer in a steady step, by (world size, policy).

    python benchmarks/host_calls.py            # ~20 s; --top 12 lists the most frequent calls

Counts, not times: they are the same on every machine, so a change to the per-layer path
shows here before it shows in ``host_overhead.py``'s times (measure those too, interleaved
A/B pairs, before calling a change a cost). Each (world size, policy): a GPT of hidden 16,
seq 8, 8 and 16 layers (``fz3.models.gpt``), real gloo processes on 127.0.0.1 with one
thread, rank 0's calls (``sys.setprofile``) during its third step call on the same
parameters, the 16-layer count less the 8-layer one over 8.

A frame counts when its file lies under fz3's package folder, matched exactly
(``os.path.dirname(fz3.__file__) + os.sep``): a substring such as ``/fz3/`` also matched
torch's own files in a clone named fz3 with its ``.venv`` inside (44 calls against 42).

This was a bound in ``tests/test_lowered.py`` from issue 26 to issue 52, which moved it here:
it pulled toward inlining while the file-size rule pulls toward splitting. Its history, calls
per layer, ``save``/``recompute`` at world size 1, then at world size 2:

- the interpreter of ``f30f498``, before the lowering: 67/71, 70/74;
- the lowered schedule (issue 26, item 1, ``ee9bc42``): 37/40, 40/43 (a first version made
  29 by inlining the project's helpers, ``or_zeros``, ``frame_of``'s check, the carry and
  the debug delay; they came back, one copy of each, at about 0.2 us a call); the arena
  (``fz3.step.arena``, off here) adds no call when off;
- a row's parameter views kept while the row lives (``fz3.step.views.RowViews``, a
  ``__call__`` per program call; each reuse saves a C++ call making a dozen views, 38-42 us):
  40/44, 44/48, plus ``forget``, whose count varied by more than half a call a layer between
  runs (44.625 against a bound of 44 on ``3c81967``); without it 39/43, 42/46;
- recompute's backward as one joined program and one rank keeping its parameter rows while
  the shards live (``fz3.step.shapes.ShardRows``): 39/42, 42/45;
- a one-layer unit's gathered buffer objects kept between gathers, their storage released at
  ``free`` and regrown (``a3e84b9``): 48/51 at world size 2 (a regrow and a release a gather,
  6 calls a layer, ~1 us, where each gather had made a dozen views, ~25 us) and no ``forget``;
- the suite's last bounds (``5aefd37``): 39/42 at world size 1, 48/51 at world size 2, and
  so this script's counts at ``5aefd37``, in a clone at ``/tmp/hc/fz3/`` with its ``.venv``
  inside too (matching ``/fz3/`` instead counted 44 and 53 for recompute there);
- each unit's memory made once (issue 52, item 1, ``fz3.step.memory``): every gather, wait
  and free calls it, and one rank gathers a copy too: 43/46 at world size 1, 46/49 at world
  size 2 (the regrow and release now one call each);
- a row's parameter views kept by its unit's memory (a dict per layer, ``RowViews``' ``made``),
  not by the maker with weak references: the same counts.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPT, GPTConfig, synthetic_batch

POLICIES = ("save", "recompute")
WORLDS = (1, 2)
PACKAGE = os.path.dirname(os.path.abspath(fz3.__file__)) + os.sep


def fz3_calls(step, params, batch) -> collections.Counter:
    """Calls into functions defined in fz3's files during one call of ``step``, by function."""
    counts: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(PACKAGE):
            counts[f"{path[len(PACKAGE):]}:{frame.f_code.co_name}"] += 1

    sys.setprofile(profile)
    try:
        step(params, batch)
    finally:
        sys.setprofile(None)
    return counts


def per_layer(rank: int, world: int, policy: str, top: int) -> dict:
    """This rank's calls per layer in a steady step under ``policy``."""
    counts = {}
    for layers in (8, 16):
        cfg = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=layers)
        torch.manual_seed(0)
        model, params = shard_gpt(GPT(cfg))
        batch = synthetic_batch(cfg, 2, seed=rank)
        kind = fz3.Policy() if policy == "recompute" else fz3.Policy(activations=policy)
        step = fz3.value_and_grad(model, kind, check_sync=False)
        step(params, batch)  # traces
        step(params, batch)
        counts[layers] = fz3_calls(step, params, batch)
    more = counts[16] - counts[8]
    return dict(calls=sum(more.values()) / 8, top={k: v / 8 for k, v in more.most_common(top)})


def _rank(rank: int, world: int, store: str, top: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result = {policy: per_layer(rank, world, policy, top) for policy in POLICIES}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top", type=int, default=0, help="list the N most frequent calls per layer")
    top = ap.parse_args().top
    print(f"fz3 at {PACKAGE}\n\n| world size | policy | calls per layer |\n|---:|---|---:|")
    for world in WORLDS:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), top, out), nprocs=world)
            with open(out) as f:
                result = json.load(f)
        for policy, r in result.items():
            print(f"| {world} | {policy} | {r['calls']:g} |")
            for name, n in r["top"].items():
                print(f"|  | `{name}` | {n:g} |")


if __name__ == "__main__":
    main()
