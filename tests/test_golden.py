"""Bitwise regression: loss and every gradient equal, bit for bit, to what ``main`` computed at
commit 9b11cfc (before the executor redesign) on CPU, for the test models at world sizes 1 and 2.

``tests/golden/main-9b11cfc.json`` holds, per case, the loss as ``float.hex`` and a SHA-256 prefix
of each gathered fp32 gradient (by original parameter name). World sizes 1 and 2 only: at 3+
ranks gloo's ring reduce-scatter sums a chunk's contributions in an order that depends on where
the chunk falls, so a new unit layout may change the last bits there without any bug.

A mismatch names the case and the parameters whose bits changed. Values may change only when an
issue says so (a new unit layout, say), by parameter name, in the commit that changes them.
Regenerate with ``python tests/test_golden.py OUT.json`` and review the diff.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys

import pytest
import torch

import dist
import fz3
from fz3.models.gpt import GPTConfig
from fz3.models import shard_gpt
from reference import batches, gpt

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "main-9b11cfc.json")
UNEVEN = GPTConfig(vocab=37, seq=8, dim=36, heads=4, layers=3)
POLICIES = {
    "default": fz3.Policy(),
    "save": fz3.Policy(activations="save"),
    "prefetch0": fz3.Policy(prefetch=0),
    "lpu2_save_allreduce": fz3.Policy(layers_per_unit=2, activations="save", reduce="all_reduce"),
    "lpu3_unsharded": fz3.Policy(layers_per_unit=3, activations="save_unsharded"),
}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().float().numpy().tobytes()).hexdigest()[:16]


def _record(model, loss, grads) -> dict | None:
    sd = fz3.full_state_dict(model, grads)
    if sd is None:
        return None
    return {"loss": float(loss).hex(), "grads": {n: _digest(g) for n, g in sorted(sd.items())}}


def golden_ranks(rank, world):
    from test_hf import batch as hf_batch, build as hf_build
    from test_models import Net, _batch, _layer, _post, _pre

    out = {}
    for tie in (False, True):
        cfg = dataclasses.replace(UNEVEN, tie=tie)
        model, params = shard_gpt(gpt(cfg))
        bs = batches(cfg, world)
        for name, policy in POLICIES.items():
            loss, grads = fz3.value_and_grad(model, policy)(params, bs[rank])
            out[f"gpt tie={tie} {name}"] = _record(model, loss, grads)
        out[f"gpt tie={tie} apply"] = {"loss": float(fz3.apply(model, params, bs[rank])).hex()}
        for acc in ("reduce", "defer"):
            micro = [batches(cfg, world, step=s)[rank] for s in range(2)]
            loss, grads = fz3.accumulate(model, fz3.Policy(), policy=acc)(params, micro)
            out[f"gpt tie={tie} accumulate {acc}"] = _record(model, loss, grads)
    cfg = dataclasses.replace(UNEVEN, dropout=0.2)  # recompute replays the forward's dropout masks
    model, params = shard_gpt(gpt(cfg).train())
    bs = batches(cfg, world)
    for name in ("default", "save"):
        torch.manual_seed(7 + rank)
        loss, grads = fz3.value_and_grad(model, POLICIES[name])(params, bs[rank])
        out[f"gpt dropout {name}"] = _record(model, loss, grads)
    model, params = shard_gpt(gpt(UNEVEN), precision=fz3.Precision(torch.bfloat16, torch.float32))
    loss, grads = fz3.value_and_grad(model)(params, batches(UNEVEN, world)[rank])
    out["gpt bf16"] = _record(model, loss, grads)
    for layers, tie in ((3, True), (1, False)):
        torch.manual_seed(0)
        model, params = fz3.shard(Net(layers=layers, tie=tie), layers="blocks", pre=_pre, post=_post, call_layer=_layer)
        for name in ("default", "save"):
            loss, grads = fz3.value_and_grad(model, POLICIES[name])(params, _batch(rank))
            out[f"net layers={layers} tie={tie} {name}"] = _record(model, loss, grads)
    for family in ("gpt2", "llama", "roberta"):
        module = hf_build(family, False).train()
        model, params = fz3.shard(module)
        loss, grads = fz3.value_and_grad(model)(params, hf_batch(family, rank, module.config.vocab_size))
        out[f"hf {family} default"] = _record(model, loss, grads)
    return out if rank == 0 else None


@pytest.mark.parametrize("world", [1, 2])
def test_bitwise_equal_to_main_before_the_redesign(world):
    with open(GOLDEN) as f:
        want = json.load(f)["worlds"][str(world)]
    got = dist.run(world, golden_ranks, timeout=300)[0]
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    bad = []
    for case, w in sorted(want.items()):
        g = got[case]
        if g["loss"] != w["loss"]:
            bad.append(f"{case}: loss {float.fromhex(g['loss'])!r} != {float.fromhex(w['loss'])!r}")
        changed = sorted(n for n in w.get("grads", {}) if g["grads"].get(n) != w["grads"][n])
        if changed or set(g.get("grads", {})) != set(w.get("grads", {})):
            bad.append(f"{case}: gradient bits changed for {changed or sorted(set(g['grads']) ^ set(w['grads']))}")
    assert not bad, "\n".join(bad)


if __name__ == "__main__":
    result = {str(w): dist.run(w, golden_ranks, timeout=300)[0] for w in (1, 2)}
    with open(sys.argv[1], "w") as f:
        json.dump({"commit": "(regenerated)", "worlds": result}, f, indent=1, sort_keys=True)
