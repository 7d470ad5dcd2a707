"""Bit-for-bit comparison of two fz3 trees on a fixed matrix of small training runs.

    PYTHONPATH=/work/main python benchmarks/bitwise.py --out /tmp/a.pt     # ~2 min on 2 cores
    PYTHONPATH=/work/mem  python benchmarks/bitwise.py --out /tmp/b.pt
    python benchmarks/bitwise.py --compare /tmp/a.pt /tmp/b.pt            # exits 1 on a difference

``--out`` runs, with whichever fz3 is importable (``PYTHONPATH``; the path is printed and
saved), every case below and saves per case and step the loss, the gradients and the
parameters after the optimizer step, as full tensors by name on rank 0
(``fz3.full_state_dict``). ``--compare`` prints one row per case: whether losses, gradients and
parameters are equal (``torch.equal`` on every tensor) and the largest absolute difference;
a case that raised shows its error, a case only one file has shows as missing.

The matrix: two models,

- ``gpt``: ``fz3.models.gpt``, 4 layers, dim 64, 4 heads, seq 16, vocab 64, tied embeddings,
  dropout 0.1 (so recompute's RNG replay is compared too);
- ``aux``: ``tests/test_layer_aux.py``'s ``Net`` (``layer_aux=True``: two stacks whose layers
  return an auxiliary output the loss reads; dropout in its layers),

each at world sizes 1 and 2 (real gloo processes on 127.0.0.1, one thread per rank), traced
and ``trace=False``, under the policies ``recompute``, ``save``, ``selective``, ``mixed`` (the
default schedule with its stack units' forwards set by hand to save, selective, recompute,
save: the per-unit mix ``fz3.plan(memory=)`` makes, fixed here because the planner times),
``join_grads`` (recompute with ``Policy(join_grads=True)``), ``k2`` (``layers_per_unit=2``),
``resident`` (``save`` with the non-stack parts resident), ``unsharded`` (``save`` with
``reshard_after_forward=False``) and ``accumulate`` (``fz3.accumulate`` over two
micro-batches); and ``gpt`` at world size 2 with bf16 compute (``fz3.Precision(bfloat16,
float32)``) under ``recompute`` and ``save``. Each case: a fresh ``fz3.shard`` of a seeded
module, ``fz3.optim.adamw`` (``decay_mask``), two steps of the step function then
``fz3.optim.step(..., donate=True)``, each rank its own batch per step, the RNG seeded per
step and rank.

Checked 2026-12-07 on ``5aefd37`` (2 shared cores, load 2-5): two runs 83 s and 100 s, all 74
cases equal (in each run traced equals ``trace=False`` and ``save`` equals ``recompute``, bit
for bit); with one element of ``join_grads``' joined gradient moved by one ulp
(``fz3/step/unit_io.py``'s ``joined``, in a scratch copy) the eight ``join_grads`` rows, and
only those, read NOT EQUAL (gradients, 1.2e-10 to 1.5e-8) and the command exited 1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
STEPS = 2
POLICIES = ("recompute", "save", "selective", "mixed", "join_grads", "k2", "resident",
            "unsharded", "accumulate")
MIXED = ("forward_save", "forward_selective", "forward", "forward_save")  # by stack unit


def _gpt(precision):
    import fz3
    from fz3.models import shard_gpt
    from fz3.models.gpt import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab=64, seq=16, dim=64, heads=4, layers=4, dropout=0.1, tie=True)
    torch.manual_seed(0)
    kwargs = {} if precision is None else {"precision": fz3.Precision(precision, torch.float32)}
    model, params = shard_gpt(GPT(cfg), **kwargs)
    return model, params, lambda seed: synthetic_batch(cfg, 2, seed=seed)


def _aux(precision):
    import fz3

    sys.path.insert(0, TESTS)
    import test_layer_aux as aux

    model, params = fz3.shard(aux.Net(), "layers", aux.pre, aux.post, layer_aux=True)
    return model, params, lambda seed: torch.randn(
        2, 5, 4, generator=torch.Generator().manual_seed(10 + seed))


MODELS = {"gpt": _gpt, "aux": _aux}


def _schedule(model, policy: str):
    """The ``Policy`` or hand-mixed ``Schedule`` of ``policy``."""
    import fz3
    from fz3.schedule.structure import Role

    if policy == "mixed":
        base = fz3.plan(model, fz3.Policy())
        stack = [u for u, unit in enumerate(base.units) if unit.role is Role.STACK]
        kinds = {u: MIXED[i % len(MIXED)] for i, u in enumerate(stack)}
        ops = tuple(fz3.Op(kinds[op.unit], op.unit) if op.kind == "forward" and op.unit in kinds
                    else op for op in base.ops)
        return fz3.validate(fz3.Schedule(ops, base.units, base.reduce, base.grad))
    parts = [p.name for p in model.parts if p.role is not Role.STACK]
    return {"recompute": fz3.Policy(), "accumulate": fz3.Policy(),
            "save": fz3.Policy(activations="save"),
            "selective": fz3.Policy(activations="selective"),
            "join_grads": fz3.Policy(join_grads=True),
            "k2": fz3.Policy(layers_per_unit=2),
            "resident": fz3.Policy(activations="save", resident=tuple(parts)),
            "unsharded": fz3.Policy(activations="save", reshard_after_forward=False)}[policy]


def run_case(rank: int, world: int, name: str, policy: str, trace: bool, precision) -> dict:
    """One case on this rank: per step the loss, and on rank 0 the full grads and params."""
    import fz3

    model, params, batch_of = MODELS[name](precision)
    schedule = _schedule(model, policy)
    if policy == "accumulate":
        fn = fz3.accumulate(model, schedule, trace=trace)
    else:
        fn = fz3.value_and_grad(model, schedule, trace=trace)
    opt = fz3.optim.adamw(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                          mask=fz3.decay_mask(model))
    state = opt.init(params)
    out = {"loss": [], "grads": [], "params": []}
    for step in range(STEPS):
        torch.manual_seed(1000 * step + rank)
        seed = 100 * step + rank * 10
        batch = ([batch_of(seed), batch_of(seed + 1)] if policy == "accumulate"
                 else batch_of(seed))
        loss, grads = fn(params, batch)
        out["loss"].append(torch.as_tensor(loss).detach().clone())
        out["grads"].append(fz3.full_state_dict(model, grads))
        params, state = fz3.optim.step(opt, grads, state, params, donate=True)
        out["params"].append(fz3.full_state_dict(model, params))
    return out


def cases(world: int) -> list[tuple[str, str, str, bool, object]]:
    """(case name, model, policy, trace, compute dtype or None) at ``world`` ranks."""
    out = [(f"{m}/w{world}/{p}/{'trace' if t else 'eager'}", m, p, t, None)
           for m in MODELS for p in POLICIES for t in (True, False)]
    if world == 2:
        out += [(f"gpt/w2/{p}/trace/bf16", "gpt", p, True, torch.bfloat16)
                for p in ("recompute", "save")]
    return out


def _rank(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    import fz3  # noqa: F401 - imported before any case, as a user's program does

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    for case, name, policy, trace, precision in cases(world):
        try:
            results[case] = run_case(rank, world, name, policy, trace, precision)
        except Exception:  # noqa: BLE001 - recorded as the case's result (fz3 raises on every rank)
            results[case] = {"error": traceback.format_exc(limit=-3)}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def record(path: str) -> None:
    import fz3

    started = time.monotonic()
    results = {"_fz3": os.path.dirname(os.path.abspath(fz3.__file__))}
    print(f"fz3 from {results['_fz3']}")
    for world in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            part = os.path.join(tmp, "out.pt")
            mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), part), nprocs=world)
            results.update(torch.load(part))
        print(f"world size {world}: done at {time.monotonic() - started:.0f} s")
    torch.save(results, path)
    errors = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    print(f"{len(results) - 1} cases to {path}; raised: {errors or 'none'}")


def _tensors(entry: dict, key: str) -> list[tuple[str, torch.Tensor]]:
    if key == "loss":
        return [(f"step {i}", t) for i, t in enumerate(entry["loss"])]
    return [(f"step {i} {n}", t) for i, d in enumerate(entry[key]) for n, t in d.items()]


def _diff(a: dict, b: dict, key: str) -> tuple[bool, float]:
    """Equal bit for bit (names, dtypes, shapes, values), and the largest absolute difference."""
    ta, tb = dict(_tensors(a, key)), dict(_tensors(b, key))
    if ta.keys() != tb.keys():
        return False, float("nan")
    equal, most = True, 0.0
    for n, x in ta.items():
        y = tb[n]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False, float("nan")
        equal &= torch.equal(x, y)
        if x.numel():
            most = max(most, float((x.double() - y.double()).abs().max()))
    return equal, most


def compare(path_a: str, path_b: str) -> bool:
    a, b = torch.load(path_a), torch.load(path_b)
    print(f"A: {path_a} (fz3 from {a.pop('_fz3')})\nB: {path_b} (fz3 from {b.pop('_fz3')})\n")
    print("| case | loss | grads | params | max abs diff |\n|---|---|---|---|---:|")
    same = True
    for case in list(a) + [c for c in b if c not in a]:
        x, y = a.get(case), b.get(case)
        if x is None or y is None or "error" in x or "error" in y:
            what = ("missing in " + ("A" if x is None else "B") if x is None or y is None else
                    "raised in " + " and ".join(k for k, v in (("A", x), ("B", y)) if "error" in v))
            error = (x or {}).get("error") or (y or {}).get("error") or ""
            print(f"| {case} | {what} | | | {error.strip().splitlines()[-1] if error else ''} |")
            same = False
            continue
        row, most = [], 0.0
        for key in ("loss", "grads", "params"):
            equal, diff = _diff(x, y, key)
            row.append("equal" if equal else "NOT EQUAL")
            most = max(most, diff) if diff == diff else diff
            same &= equal
        print(f"| {case} | {' | '.join(row)} | {most:.3g} |")
    print("\nall equal" if same else "\nDIFFERENT (see the rows above)")
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="run the matrix with the importable fz3 and save it here")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two saved runs")
    args = ap.parse_args()
    if (args.out is None) == (args.compare is None):
        ap.error("give --out FILE or --compare A B")
    if args.out:
        record(args.out)
    else:
        sys.exit(0 if compare(*args.compare) else 1)


if __name__ == "__main__":
    main()
