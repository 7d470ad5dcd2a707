"""GPU check for a session lent one GPU (world size 1, NCCL): correctness, then speed.

    python benchmarks/gpu_check.py                      # on the GPU machine (~3-5 minutes on one H200)
    python benchmarks/gpu_check.py --device cpu --quick # dry run here: same code paths, tiny model
    python benchmarks/gpu_check.py --part hf            # only the Hugging Face Llama step (3.)
    python benchmarks/gpu_check.py --part lora          # only LoRA fine-tuning, fz3 vs FSDP2 (4.)

1. Correctness on the device: fz3's loss and gradients against plain autograd on the
   unsharded model, fp32 for several schedules (rtol 1e-5 / atol 1e-5: one device, one
   batch, the same kernels), and bf16 compute (fp32 master, fp32 reduce) against the fp32
   reference (bf16 keeps 8 mantissa bits: ~0.4% per rounding, so ~1% on the loss and a few
   % on gradient norms is expected).
2. Speed on a ~1.2B-parameter GPT in bf16 at seq 2048: tokens/s, peak CUDA memory and MFU
   of fz3, plain PyTorch (autocast, fused AdamW) and FSDP2 (bf16 params, fp32 reduce), each
   with and without activation checkpointing (fz3: ``recompute`` vs ``save``). The table
   comes last.
3. A Hugging Face step: a tiny ``LlamaForCausalLM`` built from its config, one fz3 step
   through ``fz3.shard(model)``'s built-in adapter with a padded row, with whatever
   transformers the machine has; prints that release (it runs before the speed part).
4. ``--part lora`` (not part of ``all``): LoRA r=16 fine-tuning of a 1.1B Llama-shaped model
   (TinyLlama's shape, bf16 compute, frozen base stored in bf16, fp32 LoRA weights and AdamW),
   seq 2048, micro-batch 4: peak CUDA memory and tokens/s of fz3 (``recompute`` and ``save``,
   base read from a checkpoint on disk) and FSDP2 (``fully_shard`` per block), the builders of
   ``benchmarks/lora.py``. About 3 minutes on one H200.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # lets the deterministic check run cuBLAS
import optree  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fz3  # noqa: E402
import systems  # noqa: E402
from fz3.models.gpt import GPTConfig  # noqa: E402
from fz3.models import shard_gpt  # noqa: E402


def init(device: str) -> torch.device:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 checks mean fp32
        return torch.device("cuda", 0)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    dist.init_process_group("gloo")
    return torch.device("cpu")


def correctness(device: torch.device) -> list[dict]:
    cfg = GPTConfig(vocab=101, seq=32, dim=72, heads=4, layers=3)
    batch = systems.rank_batch(cfg, 4, 0, 0, device)
    ref = systems.build(cfg, device)
    ref_loss = ref(*batch)
    ref_loss.backward()
    want = {n: p.grad.float() for n, p in ref.named_parameters()}
    rows = []
    for name, policy, dtype in [
        ("fp32 recompute", fz3.Policy(), None),
        ("fp32 save", fz3.Policy(activations="save"), None),
        ("fp32 save_unsharded", fz3.Policy(activations="save_unsharded"), None),
        ("fp32 2 layers/unit", fz3.Policy(layers_per_unit=2, prefetch=2), None),
        ("bf16 recompute", fz3.Policy(), torch.bfloat16),
        ("bf16 save", fz3.Policy(activations="save"), torch.bfloat16),
    ]:
        model, params = shard_gpt(systems.build(cfg, device), device=device,
                                  precision=fz3.Precision(dtype, torch.float32 if dtype else None))
        loss, grads = fz3.value_and_grad(model, policy)(params, batch)
        got = fz3.full_state_dict(model, grads)
        loss_rel = abs(float(loss) - float(ref_loss.detach())) / abs(float(ref_loss.detach()))
        # worst |a-b| / (atol + rtol |b|) over all elements (<= 1 means allclose)
        closeness = max(float(((got[n].to(device) - w).abs() / (1e-5 + 1e-5 * w.abs())).max()) for n, w in want.items())
        rel_norm = max(float((got[n].to(device) - w).norm() / w.norm()) for n, w in want.items())
        ok = (loss_rel <= 1e-5 and closeness <= 1.0) if dtype is None else (loss_rel <= 3e-2 and rel_norm <= 1e-1)
        rows.append(dict(check=name, loss_rel_err=loss_rel, grad_allclose_ratio=closeness,
                         grad_rel_norm_err=rel_norm, ok=ok))
        print(f"correctness {name:22s} loss rel {loss_rel:.2e}  grad closeness {closeness:.2e}  "
              f"grad rel-norm {rel_norm:.2e}  {'OK' if ok else 'FAIL'}", flush=True)
    return rows


def features(device: torch.device, quick: bool = False) -> dict:
    """On the device: a trace with device timing events, the memory plan vs the allocator's
    peak, step_through to the end, and the pure optimizer path against the donating one."""
    cfg = GPTConfig(vocab=4096, seq=512, dim=512, heads=8, layers=6) if not quick else GPTConfig(layers=3)
    batch = systems.rank_batch(cfg, 8, 0, 0, device)
    model, params = shard_gpt(systems.build(cfg, device), device=device)
    sched = fz3.plan(model, fz3.Policy(activations="save"))
    plan = fz3.memory_plan(model, sched, batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with fz3.trace("/tmp/fz3-gpu-trace.json") as rec:
        loss, grads = fz3.value_and_grad(model, sched, recorder=rec)(params, batch)
    lanes = {e["tid"] for e in fz3.chrome_trace(rec)["traceEvents"] if e["ph"] == "X"}
    out = dict(trace_device_lane=4 in lanes, trace_ops=len(rec.events))
    if device.type == "cuda":
        measured = torch.cuda.max_memory_allocated() - base
        # the plan's transient peak (gathered + unreduced grads + graphs) + the grad shards
        predicted = plan.peak - plan.params - plan.optimizer
        out.update(plan_transient_mib=predicted / 2**20, measured_step_peak_mib=measured / 2**20,
                   plan_ratio=predicted / measured)
    frames = list(fz3.step_through(model, params, batch, sched))
    out["step_through_max_rel_diff"] = max(float((a - b).norm() / b.norm()) for a, b in zip(frames[-1].result.parts, grads.parts))
    # Bit-identical needs deterministic kernels (flash / memory-efficient attention backward
    # accumulate with atomics): the math attention backend and deterministic algorithms.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.use_deterministic_algorithms(True, warn_only=True)
    with sdpa_kernel(SDPBackend.MATH):
        loss_d, grads_d = fz3.value_and_grad(model, sched)(params, batch)
        frames = list(fz3.step_through(model, params, batch, sched))
    torch.use_deterministic_algorithms(False)
    out["step_through_identical_deterministic"] = bool(torch.equal(frames[-1].loss, loss_d)) and all(
        torch.equal(a, b) for a, b in zip(frames[-1].result.parts, grads_d.parts))
    opt = fz3.optim.adamw(lr=1e-3, weight_decay=0.1, mask=fz3.decay_mask(model))
    st = opt.init(params)
    pure, _ = fz3.optim.step(opt, grads, st, params)
    fused, _ = fz3.optim.step(opt, grads, opt.init(params), optree.tree_map(torch.Tensor.clone, params), donate=True)
    out["fused_vs_pure_max_abs"] = max(float((a - b).abs().max()) for a, b in zip(pure.parts, fused.parts))
    print("features " + json.dumps(out), flush=True)
    return out


def hf_llama_step(device: torch.device) -> dict:
    """One fz3 training step (value_and_grad, AdamW) of a tiny ``LlamaForCausalLM`` through
    ``fz3.shard(model)``, with the installed transformers; the first loss must equal the plain
    HF model's (fp32, rtol 1e-5) and the step must lower it. Prints the transformers release."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    module = transformers.LlamaForCausalLM(cfg).to(device)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), device=device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # one left-padded row: the attention mask path
    batch = {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask}
    with torch.no_grad():
        ref_loss = float(module(**batch).loss)
    model, params = fz3.shard(module, device=device)
    opt = fz3.optim.adamw(lr=1e-2)
    loss, grads = fz3.value_and_grad(model)(params, batch)
    params, _ = fz3.optim.step(opt, grads, opt.init(params), params)
    after, _ = fz3.value_and_grad(model)(params, batch)
    rel = abs(float(loss) - ref_loss) / abs(ref_loss)
    ok = rel <= 1e-5 and float(after) < float(loss)
    print(f"transformers {transformers.__version__}: HF Llama step {'ok' if ok else 'FAIL'}, loss "
          f"{float(loss):.4f} -> {float(after):.4f} (plain HF {ref_loss:.4f}, rel {rel:.1e})",
          flush=True)
    return dict(transformers=transformers.__version__, loss=float(loss),
                loss_after_step=float(after), hf_loss=ref_loss, loss_rel_err=rel, ok=ok)


def lora_part(device: torch.device, quick: bool, steps: int, warmup: int) -> list[dict]:
    """LoRA fine-tuning, fz3 vs FSDP2 (``benchmarks/lora.py``): tokens/s and peak memory."""
    import tempfile

    import lora

    config = "quick" if quick else "1b"
    dtype = torch.bfloat16 if device.type == "cuda" else None
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        lora.save_base(lora.llama_config(config)[0], folder)  # fz3 reads its base from disk
        for name, system in [("fz3 recompute", "fz3 recompute"), ("fz3 save", "fz3"),
                             ("FSDP2", "FSDP2")]:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            res = lora.measure(system, config, steps, warmup, folder, device, dtype)
            step = res["fwd_bwd_s"] + res["opt_s"]
            row = dict(system=name, tokens_per_s=res["tokens_per_step"] / step, step_s=step,
                       peak_gib=res["peak_mib"] / 1024, loss=res["loss"], config=config)
            rows.append(row)
            print(f"lora {name:14s} {step * 1e3:8.1f} ms/step  {row['tokens_per_s']:9.0f} tok/s  "
                  f"peak {row['peak_gib']:6.2f} GiB  loss {res['loss']:.4f}", flush=True)
    return rows


def speed(device: torch.device, cfg: GPTConfig, batch: int, steps: int, warmup: int, deadline: float,
          quick: bool = False) -> list[dict]:
    dtype = torch.bfloat16
    runs = [
        ("plain", "no AC", lambda: systems.plain(cfg, device, dtype=dtype)),
        ("fz3", "save", lambda: systems.fz3_system(cfg, device, dtype=dtype, policy=fz3.Policy(activations="save"))),
        ("fz3", "save_unsharded",
         lambda: systems.fz3_system(cfg, device, dtype=dtype, policy=fz3.Policy(activations="save_unsharded"))),
        ("fsdp2", "no AC", lambda: systems.fsdp2(cfg, device, dtype=dtype)),
        ("plain", "AC", lambda: systems.plain(cfg, device, dtype=dtype, ac=True)),
        ("fz3", "recompute", lambda: systems.fz3_system(cfg, device, dtype=dtype)),
        ("fsdp2", "AC", lambda: systems.fsdp2(cfg, device, dtype=dtype, ac=True)),
    ]
    if quick:  # a dry run exercises each system's code once
        runs = [r for r in runs if (r[0], r[1]) in {("plain", "no AC"), ("fsdp2", "AC"), ("fz3", "recompute")}]
    rows = []
    for system, policy, make in runs:
        if time.monotonic() > deadline:
            print(f"speed {system} {policy}: skipped (time budget)", flush=True)
            continue
        step, t_build, times, host, loss = systems.time_steps(make, cfg, batch, device, steps, warmup)
        med = statistics.median(times)
        tps = batch * cfg.seq / med
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        mfu = tps * systems.flops_per_token(cfg) / systems.PEAK_BF16 if device.type == "cuda" else float("nan")
        rows.append(dict(system=system, policy=policy, step_s=med, tokens_per_s=tps, peak_gib=peak, mfu=mfu,
                         loss=float(loss), build_s=t_build, steps=steps, host_s=statistics.median(host)))
        print(f"speed {system:6s} {policy:10s} {med * 1e3:8.1f} ms/step  {tps:9.0f} tok/s  "
              f"peak {peak:6.1f} GiB  MFU {mfu:.3f}  loss {float(loss):.4f}  host {statistics.median(host) * 1e3:.1f} ms",
              flush=True)
        del step
    return rows


def table(rows: list[dict]) -> str:
    no_ac = ("no AC", "save", "save_unsharded")
    base = {r["policy"] in no_ac: r for r in rows if r["system"] == "plain"}
    fsdp = {r["policy"] in no_ac: r for r in rows if r["system"] == "fsdp2"}
    out = ["| system | activations | ms/step | tokens/s | peak GiB | MFU | vs plain | vs FSDP2 | loss |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        key = r["policy"] in no_ac
        vs_plain = r["tokens_per_s"] / base[key]["tokens_per_s"] if key in base else float("nan")
        vs_fsdp = r["tokens_per_s"] / fsdp[key]["tokens_per_s"] if key in fsdp else float("nan")
        out.append(f"| {r['system']} | {r['policy']} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | "
                   f"{r['peak_gib']:.1f} | {r['mfu']:.3f} | {vs_plain:.3f} | {vs_fsdp:.3f} | {r['loss']:.4f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="tiny model (a CPU dry run of every code path)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=420, help="skip remaining speed runs after this")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json")
    ap.add_argument("--part", default="all",
                    choices=["all", "hf", "speed", "memory", "safety", "lora"],
                    help="hf: only the Hugging Face Llama step; lora: only LoRA fz3 vs FSDP2; "
                         "speed / memory / safety: the round-2 parts in gpu_parts.py (each at "
                         "most ~4 minutes on an H200)")
    args = ap.parse_args()
    t_start = time.monotonic()
    device = init(args.device)
    if args.quick:
        cfg, batch, args.steps, args.warmup = GPTConfig(vocab=256, seq=64, dim=64, heads=4, layers=4), 2, 2, 1
    else:
        cfg, batch = GPTConfig(vocab=32768, seq=2048, dim=2048, heads=16, layers=20), 4
    env = dict(torch=torch.__version__, cuda=torch.version.cuda,
               gpu=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               config=str(cfg), micro_batch=batch, date=time.strftime("%Y-%m-%d"))
    if importlib.util.find_spec("transformers"):
        import transformers

        env["transformers"] = transformers.__version__
    print(json.dumps(env), flush=True)
    if args.part == "hf":
        hf = hf_llama_step(device)
        write(args.out, dict(env=env, hf=hf))
        dist.destroy_process_group()
        sys.exit(0 if hf["ok"] else 1)
    if args.part in ("speed", "memory", "safety"):
        sys.exit(run_part(args.part, device, env, args, t_start))
    if args.part == "lora":
        rows = lora_part(device, args.quick, args.steps, args.warmup)
        write(args.out, dict(env=env, lora=rows))
        print("\n| system | tokens/s | peak GiB | loss |\n|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['system']} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.2f} | "
                  f"{r['loss']:.4f} |")
        dist.destroy_process_group()
        return
    checks = correctness(device)
    extra = features(device, quick=args.quick)
    hf = hf_llama_step(device) if importlib.util.find_spec("transformers") else None
    if hf is None:
        print("transformers is not installed: HF Llama step skipped", flush=True)
    rows = speed(device, cfg, batch, args.steps, args.warmup, t_start + args.budget_s, quick=args.quick)
    write(args.out, dict(env=env, correctness=checks, features=extra, hf=hf, speed=rows))
    print(f"\nGPU check ({env['gpu']}, torch {env['torch']}, {cfg}, micro-batch {batch}), "
          f"{time.monotonic() - t_start:.0f}s:")
    print("correctness: " + ", ".join(f"{c['check']} {'OK' if c['ok'] else 'FAIL'}" for c in checks))
    print("features: " + json.dumps(extra))
    if hf is not None:
        print(f"transformers {hf['transformers']}: HF Llama step {'ok' if hf['ok'] else 'FAIL'}")
    print(table(rows))
    dist.destroy_process_group()


def run_part(part: str, device: torch.device, env: dict, args, t_start: float) -> int:
    """One of the round-2 parts (``gpu_parts.py``); its rows land in gpu_check_<part>.json."""
    import gpu_parts

    if part == "speed":
        rows = gpu_parts.speed(device, args.quick, t_start + args.budget_s)
        result, ok = dict(speed=rows), True
        print(gpu_parts.table(rows))
    elif part == "memory":
        rows = gpu_parts.memory(device, args.quick)
        # the plan within 10% of the allocator (no ratio on the CPU dry run)
        ok = all(abs(r["ratio"] - 1) <= 0.1 for r in rows if r.get("ratio") is not None)
        result = dict(memory=rows)
        print(gpu_parts.table(rows))
    else:
        safety = gpu_parts.safety(device)
        result = dict(safety=safety)
        ok = "skipped" in safety or (safety["no_host_sync"] is True
                                     and safety["gather_overlaps_compute"] is True)
    write(args.out, dict(env=env, **result), name=f"gpu_check_{part}.json")
    dist.destroy_process_group()
    return 0 if ok else 1


def write(folder: str | None, result: dict, name: str = "gpu_check.json") -> None:
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, name), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
