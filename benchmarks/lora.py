"""LoRA fine-tuning of a Llama-shaped model: fz3 vs FSDP2 vs DeepSpeed ZeRO-3, on CPU gloo.

    pip install -c constraints.txt -e ".[bench]"
    python benchmarks/lora.py                  # 3 interleaved repeats of each system, world size 2
    python benchmarks/lora.py --quick          # 1 repeat, 2 steps: a smoke run

The same Hugging Face ``LlamaForCausalLM`` (seed 0) with PEFT LoRA r=16 on every projection
(q, k, v, o, gate, up, down; seed 1), the same synthetic batches, torch AdamW with
``fused=True`` over the LoRA weights everywhere (fz3: ``fz3.optim.step(..., donate=True)``,
torch's fused kernel on the shards). The base is frozen: fz3 shards it from the checkpoint
on disk (``weights=``, the model built on meta); FSDP2 ``fully_shard``s each block and the
root of a model built on every rank; DeepSpeed ZeRO-3 partitions it at ``initialize``.

Each (system, repeat) is a fresh ``torchrun`` job, repeats interleaved across systems.
Reported per system: median over repeats of the median forward+backward and optimizer step
times, and the peak RSS per rank above the process's RSS after imports, during the timed
steps (after a warm-up: the peak is reset then, ``/proc/self/clear_refs``, after ``gc`` and
``malloc_trim``, so a build that held the whole model once does not count; what a system
keeps counts). The largest rank's value.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS = {
    # CPU: Llama-shaped, small enough for 2 cores (20.6M parameters, 0.59M of them LoRA)
    "cpu": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        seq=128,
        batch=4,
    ),
    # GPU check: TinyLlama-1.1B's shape
    "1b": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        seq=2048,
        batch=4,
    ),
    "quick": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        seq=32,
        batch=2,
    ),
}
SYSTEMS = ("fz3", "fz3 recompute", "FSDP2", "DeepSpeed ZeRO-3")
LR = 1e-3


def llama_config(name: str):
    import transformers

    c = dict(CONFIGS[name])
    seq, batch = c.pop("seq"), c.pop("batch")
    return transformers.LlamaConfig(max_position_embeddings=seq, **c), seq, batch


def peft_model(cfg, device, dtype=None, meta: bool = False):
    """The PEFT LoRA model, base weights seed 0 (``dtype``: the frozen base's), LoRA seed 1 (fp32,
    PEFT's init through ``fz3.hf.init_lora``, so a base on meta gets the same LoRA values)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    import fz3

    torch.manual_seed(0)
    with torch.device("meta" if meta else device):
        base = transformers.LlamaForCausalLM(cfg)
    if dtype is not None:
        base = base.to(dtype)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS)
    model = get_peft_model(base, lora)
    torch.manual_seed(1)  # the same LoRA values whether the base is real or on meta
    fz3.hf.init_lora(model, device)
    return model if dtype is None else _lora_fp32(model)


def _lora_fp32(model):
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


def save_base(cfg, folder: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)


def fz3_system(cfg, device, dtype, folder, policy=None):
    """``(forward_backward(batch) -> loss, optimizer_step())``; ``policy``: a ``fz3.Policy``."""
    import torch

    import fz3

    precision = fz3.Precision(dtype, torch.float32) if dtype else fz3.Precision()
    module = peft_model(cfg, device, meta=True)
    model, params = fz3.shard(module, weights=folder, device=device, precision=precision)
    opt = fz3.optim.adamw(lr=LR, weight_decay=0.0)
    value_and_grad = fz3.value_and_grad(model, policy)
    carry = {"params": params, "state": opt.init(params)}

    def forward_backward(batch):
        loss, carry["grads"] = value_and_grad(carry["params"], batch)
        return loss

    def optimizer_step():
        carry["params"], carry["state"] = fz3.optim.step(
            opt, carry.pop("grads"), carry["state"], carry["params"], donate=True
        )

    return forward_backward, optimizer_step


def _torch_adamw(model):
    import torch

    trained = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trained, lr=LR, weight_decay=0.0, fused=True)


def fsdp2_system(cfg, device, dtype, folder):
    """FSDP2: ``fully_shard`` per block and the root; frozen and trained weights in one group."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = peft_model(cfg, device, dtype)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else None
    kw = {"mp_policy": mp} if mp else {}
    for block in model.get_base_model().model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = _torch_adamw(model)

    def forward_backward(batch):
        loss = model(**batch).loss
        loss.backward()
        return loss.detach()

    def optimizer_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return forward_backward, optimizer_step


def deepspeed_system(cfg, device, dtype, folder):
    """DeepSpeed ZeRO-3 (CPU accelerator on gloo), client torch AdamW over the LoRA weights."""
    import deepspeed

    import systems

    model = peft_model(cfg, device)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=_torch_adamw(model), config=systems.ds_zero3_config(),
        dist_init_required=False
    )

    def forward_backward(batch):
        loss = engine(**batch).loss
        engine.backward(loss)
        return loss.detach()

    return forward_backward, engine.step


def fz3_save(cfg, device, dtype, folder):
    """fz3 keeping each layer's graph (``activations="save"``): like FSDP2 without activation
    checkpointing. LoRA's backward costs about one forward (no weight gradients for the base),
    so recomputing the forward (fz3's default) adds about half a step."""
    import fz3

    return fz3_system(cfg, device, dtype, folder, fz3.Policy(activations="save"))


BUILDERS = {
    "fz3": fz3_save,
    "fz3 recompute": fz3_system,
    "FSDP2": fsdp2_system,
    "DeepSpeed ZeRO-3": deepspeed_system,
}


def rank_batch(cfg, seq: int, per_rank: int, step: int, rank: int, device) -> dict:
    import torch

    g = torch.Generator().manual_seed(10_000 * step + rank)
    ids = torch.randint(0, cfg.vocab_size, (per_rank, seq), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


def rss_kib(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak() -> None:
    """Return freed memory to the OS, then reset the peak RSS (Linux >= 4.0)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(
    system: str, config: str, steps: int, warmup: int, folder: str, device, dtype=None, **kw
) -> dict:
    """Build ``system`` (``kw``: its builder's options), run ``warmup`` + ``steps`` steps;
    times and peak memory of this rank (MiB: CUDA's allocator peak, or the peak RSS)."""
    import torch
    import torch.distributed as dist

    import systems

    cfg, seq, per_rank = llama_config(config)
    rank = dist.get_rank()
    cuda = device.type == "cuda"
    forward_backward, optimizer_step = BUILDERS[system](cfg, device, dtype, folder, **kw)
    fb, op, loss = [], [], None
    for s in range(warmup + steps):
        if s == warmup:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            else:
                reset_peak()
        batch = rank_batch(cfg, seq, per_rank, s, rank, device)
        t0 = time.perf_counter()
        loss = forward_backward(batch)
        systems.sync(device)
        t1 = time.perf_counter()
        optimizer_step()
        systems.sync(device)
        t2 = time.perf_counter()
        if s >= warmup:
            fb.append(t1 - t0)
            op.append(t2 - t1)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_kib("VmHWM") / 1024
    mean = torch.tensor([float(loss)], dtype=torch.float64, device=device)
    dist.all_reduce(mean)
    return dict(
        fwd_bwd_s=statistics.median(fb),
        opt_s=statistics.median(op),
        peak_mib=peak,
        loss=float(mean) / dist.get_world_size(),
        tokens_per_step=per_rank * seq * dist.get_world_size(),
    )


def worker(spec: dict) -> None:
    """One rank of one run."""
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401  (imports before the baseline)
    import peft  # noqa: F401

    import fz3  # noqa: F401

    torch.set_num_threads(1)
    if spec["system"] == "DeepSpeed ZeRO-3":  # it sets up its own process group
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    baseline = rss_kib() / 1024  # MiB after imports
    res = measure(
        spec["system"],
        spec["config"],
        spec["steps"],
        spec["warmup"],
        spec["folder"],
        torch.device("cpu"),
    )
    res["peak_mib"] -= baseline
    peak = torch.tensor([res["peak_mib"]])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    res["peak_mib"] = float(peak)
    if dist.get_rank() == 0:
        with open(spec["out"], "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def launch(system: str, args: argparse.Namespace, folder: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        spec = dict(
            system=system,
            config=args.config,
            steps=args.steps,
            warmup=args.warmup,
            folder=folder,
            out=out,
        )
        env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.world}",
            os.path.abspath(__file__),
            "--worker",
            json.dumps(spec),
        ]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if p.returncode != 0 or not os.path.exists(out):
            return dict(error=(p.stderr or p.stdout)[-2000:])
        with open(out) as f:
            return json.load(f)


def table(results: dict[str, list[dict]], args: argparse.Namespace) -> str:
    def med(runs, key):
        ok = [r[key] for r in runs if "error" not in r]
        return statistics.median(ok) if ok else float("nan")

    cfg, seq, batch = llama_config(args.config)
    lines = [
        f"LoRA r=16 on q,k,v,o,gate,up,down of a Llama-shaped model ({args.config}: vocab "
        f"{cfg.vocab_size}, hidden {cfg.hidden_size}, MLP {cfg.intermediate_size}, "
        f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads / "
        f"{cfg.num_key_value_heads} KV, seq {seq}, micro-batch {batch} per rank), world "
        f"size {args.world}, fp32, medians of {args.repeats} interleaved repeats of "
        f"{args.steps} steps after {args.warmup}",
        "",
        "| system | fwd+bwd ms | optimizer ms | step ms | tokens/s | step / FSDP2's (paired) "
        "| peak RSS MiB/rank | loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in results.items():
        fb, op = med(runs, "fwd_bwd_s"), med(runs, "opt_s")
        tokens = next((r["tokens_per_step"] for r in runs if "error" not in r), float("nan"))
        paired = _paired(runs, results.get("FSDP2", []))
        lines.append(
            f"| {name} | {fb * 1e3:.1f} | {op * 1e3:.2f} | {(fb + op) * 1e3:.1f} | "
            f"{tokens / (fb + op):.0f} | {paired:.2f} | {med(runs, 'peak_mib'):.0f} | "
            f"{med(runs, 'loss'):.4f} |"
        )
    return "\n".join(lines)


def _paired(runs: list[dict], ref: list[dict]) -> float:
    """Median over repeats of this system's step time over FSDP2's in the same repeat: the
    machine drifts (other users), and one repeat's runs are next to each other in time."""
    ratios = [
        (a["fwd_bwd_s"] + a["opt_s"]) / (b["fwd_bwd_s"] + b["opt_s"])
        for a, b in zip(runs, ref)
        if "error" not in a and "error" not in b
    ]
    return statistics.median(ratios) if ratios else float("nan")


def _resolved(args: argparse.Namespace) -> argparse.Namespace:
    """``--quick`` spelled out (a saved run's table is printed with what it ran)."""
    if args.quick:
        args.config, args.repeats, args.steps, args.warmup = "quick", 1, 2, 1
    return args


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="tiny config, 1 repeat, 2 steps")
    ap.add_argument("--config", default="cpu", choices=sorted(CONFIGS))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=None, help="write lora.json and lora.md into this folder")
    ap.add_argument("--report", metavar="JSON", help="print the table of a saved lora.json again")
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        print(table(saved["results"], _resolved(ap.parse_args(saved["argv"]))))
        return
    args = _resolved(args)
    systems = args.systems.split(",")
    results: dict[str, list[dict]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory() as folder:
        save_base(llama_config(args.config)[0], folder)  # the "pretrained" checkpoint fz3 reads
        for r in range(args.repeats):
            for system in systems:
                res = launch(system, args, folder)
                results[system].append(res)
                msg = (
                    (res["error"].splitlines() or ["failed"])[-1]
                    if "error" in res
                    else (
                        f"fwd+bwd {res['fwd_bwd_s'] * 1e3:7.1f} ms  "
                        f"opt {res['opt_s'] * 1e3:6.2f} ms  "
                        f"peak {res['peak_mib']:6.0f} MiB  loss {res['loss']:.4f}"
                    )
                )
                print(f"[repeat {r + 1}/{args.repeats}] {system:17s} {msg}", flush=True)
    report = table(results, args)
    print("\n" + report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "lora.json"), "w") as f:
            json.dump(
                dict(results=results, argv=sys.argv[1:], date=str(datetime.date.today())),
                f,
                indent=1,
            )
        with open(os.path.join(args.out, "lora.md"), "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
