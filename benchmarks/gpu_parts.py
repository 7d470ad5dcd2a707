"""The GPU check's parts for the round-2 issues (run through ``benchmarks/gpu_check.py --part``):

- ``speed``: the host-overhead table (issue 14): a host-bound 48-layer GPT (hidden 512, seq
  512, micro-batch 8) and a 1.3B GPT (24 layers, hidden 2048, seq 2048, micro-batch 4), bf16
  compute with fp32 master weights, fused AdamW everywhere: plain eager, plain with compiled
  blocks, plain + AC, FSDP2 (per block, compiled blocks, + AC) and fz3 (save, recompute,
  compiled). Per system: ms/step, the host's time to issue the step, the GPU's
  busy time (the sum of kernel time from ``torch.profiler``: the limit of a host-bound
  step), peak memory, tokens/s and MFU.
- ``memory``: peak CUDA memory (issue 13) on the 1.3B GPT for plain, FSDP2 and fz3 with
  activations kept and recomputed, and ``fz3.memory_plan`` against
  ``torch.cuda.max_memory_allocated`` (within 10%).
- ``safety``: the GPU tier of issue 15: one step under ``torch.cuda.set_sync_debug_mode("error")``
  (no hidden host syncs), CUDA events showing the next layer's gather overlapping the current
  layer's compute. (The core equality at world size >= 2 on NCCL needs 2 GPUs: not here.)

Every part prints its rows as it goes and returns them for ``gpu_check.json``.
"""

from __future__ import annotations

import statistics
import time

import torch

import fz3
import systems
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig

MODELS = {
    "48 layers h512": (GPTConfig(vocab=32000, seq=512, dim=512, heads=8, layers=48), 8),
    "1.3B": (GPTConfig(vocab=32000, seq=2048, dim=2048, heads=16, layers=24), 4),
}
QUICK = {"tiny": (GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=4), 2)}


def _systems(cfg: GPTConfig, device: torch.device, big: bool) -> list[tuple[str, object]]:
    bf = torch.bfloat16
    fz = lambda **kw: lambda: systems.fz3_system(cfg, device, dtype=bf, **kw)  # noqa: E731
    rows = [
        ("plain eager", lambda: systems.plain(cfg, device, dtype=bf)),
        ("plain compiled blocks", lambda: systems.plain(cfg, device, dtype=bf, compile_blocks=True)),
        ("fz3 save", fz(policy=fz3.Policy(activations="save"))),
        ("fz3 save compiled", fz(policy=fz3.Policy(activations="save"), compile=True)),
        ("FSDP2", lambda: systems.fsdp2(cfg, device, dtype=bf)),
        ("FSDP2 compiled blocks", lambda: systems.fsdp2(cfg, device, dtype=bf, compile_blocks=True)),
        ("plain + AC", lambda: systems.plain(cfg, device, dtype=bf, ac=True)),
        ("fz3 recompute", fz(policy=fz3.Policy())),
        ("fz3 recompute compiled", fz(policy=fz3.Policy(), compile=True)),
        ("FSDP2 + AC", lambda: systems.fsdp2(cfg, device, dtype=bf, ac=True)),
    ]
    if big:  # compiling every peer on the 1.3B model does not fit the part's time: fz3's own rows stay
        rows = [r for r in rows if r[0] not in ("plain compiled blocks", "FSDP2 compiled blocks")]
    if device.type != "cuda":
        rows = [r for r in rows if "cuda graphs" not in r[0]]
    return rows


def _busy_ms(step, batches, device: torch.device) -> float:
    """The GPU's busy time per step: the sum of its kernels' durations (``torch.profiler``)."""
    if device.type != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for b in batches:
            step(b)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / 1e3 / len(batches)


def speed(device: torch.device, quick: bool, deadline: float, steps: int = 6, warmup: int = 3) -> list[dict]:
    rows = []
    for model_name, (cfg, micro) in (QUICK if quick else MODELS).items():
        for name, make in _systems(cfg, device, big=model_name == "1.3B"):
            if time.monotonic() > deadline:
                print(f"speed {model_name} {name}: skipped (time budget)", flush=True)
                continue
            rows.append(_run(model_name, name, make, cfg, micro, device, steps, warmup))
    return rows


def _run(model_name: str, name: str, make, cfg: GPTConfig, micro: int, device: torch.device, steps: int,
         warmup: int) -> dict:
    step, build, times, host, loss = systems.time_steps(make, cfg, micro, device, steps, warmup)
    busy = _busy_ms(step, [systems.rank_batch(cfg, micro, s, 0, device) for s in range(3)], device)
    med = statistics.median(times)
    tps = micro * cfg.seq / med
    flops = systems.flops_per_token(cfg)
    row = dict(model=model_name, system=name, step_ms=med * 1e3, host_ms=statistics.median(host) * 1e3,
               busy_ms=busy, x_busy=med * 1e3 / busy if busy == busy else float("nan"), tokens_per_s=tps,
               mfu=tps * flops / systems.PEAK_BF16 if device.type == "cuda" else float("nan"),
               peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan"),
               loss=float(loss), build_s=build)
    print(f"speed {model_name:15s} {name:26s} {row['step_ms']:8.1f} ms  host {row['host_ms']:7.1f}  busy "
          f"{busy:7.1f} ms ({row['x_busy']:.2f}x)  {tps:9.0f} tok/s  MFU {row['mfu']:.3f}  peak "
          f"{row['peak_gib']:5.1f} GiB  loss {row['loss']:.4f}", flush=True)
    del step
    return row


def memory(device: torch.device, quick: bool) -> list[dict]:
    """Peak memory per system, both activation modes; fz3's plan against the allocator."""
    name, (cfg, micro) = next(iter((QUICK if quick else {"1.3B": MODELS["1.3B"]}).items()))
    rows = []
    bf = torch.bfloat16
    for label, make in (("plain", lambda: systems.plain(cfg, device, dtype=bf)),
                        ("FSDP2", lambda: systems.fsdp2(cfg, device, dtype=bf)),
                        ("fz3 save", lambda: systems.fz3_system(cfg, device, dtype=bf,
                                                                policy=fz3.Policy(activations="save"))),
                        ("plain + AC", lambda: systems.plain(cfg, device, dtype=bf, ac=True)),
                        ("FSDP2 + AC", lambda: systems.fsdp2(cfg, device, dtype=bf, ac=True)),
                        ("fz3 recompute", lambda: systems.fz3_system(cfg, device, dtype=bf)),
                        # selective recompute (issue 25) and its like-for-like peers: per-op SAC
                        ("plain + SAC", lambda: systems.plain(cfg, device, dtype=bf, sac=True)),
                        ("FSDP2 + SAC", lambda: systems.fsdp2(cfg, device, dtype=bf, sac=True)),
                        ("fz3 selective", lambda: systems.fz3_system(
                            cfg, device, dtype=bf, policy=fz3.Policy(activations="selective")))):
        rows.append(_run(name, label, make, cfg, micro, device, steps=2, warmup=1))
    for policy in (fz3.Policy(activations="save"), fz3.Policy(),
                   fz3.Policy(activations="selective")):
        model, params = shard_gpt(systems.build(cfg, device), device=device, precision=fz3.Precision(bf, torch.float32))
        batch = systems.rank_batch(cfg, micro, 0, 0, device)
        sched = fz3.plan(model, policy)
        plan = fz3.memory_plan(model, sched, batch)
        step = fz3.value_and_grad(model, sched)
        step(params, batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        step(params, batch)
        measured = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else float("nan")
        predicted = plan.peak - plan.params - plan.optimizer
        rows.append(dict(model=name, system=f"plan vs allocator, {policy.activations}", predicted_gib=predicted / 2**30,
                         measured_gib=measured / 2**30, ratio=predicted / measured if measured == measured else None))
        print(f"memory plan {policy.activations}: predicted {predicted / 2**30:.2f} GiB, measured "
              f"{measured / 2**30:.2f} GiB", flush=True)
        del model, params, step
    return rows


def safety(device: torch.device) -> dict:
    """No hidden host syncs in a step; the next layer's gather overlaps this layer's compute."""
    if device.type != "cuda":
        return dict(skipped="the GPU tier needs a GPU")
    cfg = GPTConfig(vocab=1024, seq=256, dim=512, heads=8, layers=6)
    model, params = shard_gpt(systems.build(cfg, device), device=device)
    batch = systems.rank_batch(cfg, 4, 0, 0, device)
    step = fz3.value_and_grad(model)
    step(params, batch)
    torch.cuda.synchronize()
    out = {}
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(params, batch)
        out["no_host_sync"] = True
    except RuntimeError as e:
        out["no_host_sync"] = False
        out["sync_error"] = str(e).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # Through NCCL even on one GPU (fz3 otherwise copies locally): the gathers run on NCCL's
    # stream. The compute stream stalls only in ``wait`` ops whose gather had not finished: if
    # the next layer's gather overlaps this layer's compute, the waits' device spans are small.
    import dataclasses

    nccl = dataclasses.replace(model, comm=dataclasses.replace(model.comm, local_copies=False))
    step = fz3.value_and_grad(nccl)
    step(params, batch)
    rec = fz3.Recorder()
    fz3.value_and_grad(nccl, recorder=rec)(params, batch)
    times = rec.device_times()
    kinds = [str(e.op.kind) for e in rec.step_events()]
    waits = sum(b - a for k, (a, b) in zip(kinds, times) if k == "wait")
    total = times[-1][1] - times[0][0]
    out["wait_share_of_step"] = waits / total
    out["gather_overlaps_compute"] = waits / total < 0.05
    print("safety " + str(out), flush=True)
    return out


def table(rows: list[dict]) -> str:
    out = ["| model | system | ms/step | host ms | GPU busy ms | x busy | tokens/s | MFU | peak GiB | loss |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "step_ms" not in r:
            continue
        out.append(f"| {r['model']} | {r['system']} | {r['step_ms']:.1f} | {r['host_ms']:.1f} | {r['busy_ms']:.1f} | "
                   f"{r['x_busy']:.2f} | {r['tokens_per_s']:.0f} | {r['mfu']:.3f} | {r['peak_gib']:.1f} | "
                   f"{r['loss']:.4f} |")
    return "\n".join(out)
