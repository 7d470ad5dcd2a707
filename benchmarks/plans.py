"""Plans for runs this machine cannot hold, from fz3's cost model (fz3/cost.py).

    python benchmarks/plans.py            # prints the markdown tables kept in benchmarks/HISTORY.md

1. The seed's 10B RobertaForMaskedLM (30 layers, hidden 5120, intermediate 20480, seq 512,
   micro-batch 8, gradient checkpointing) on 16 p3dn hosts (8x V100, 100 Gbps) and on 4 p4d
   hosts (8x A100, 400 Gbps), next to the seed's measured ZeRO-2 and ZeRO-3 TFLOPS/GPU.
2. A Llama-70B-class model on 1,024 GPUs (128 nodes of 8x H100, 400 Gbps per GPU): which
   mesh shape, prefetch depth and micro-batch keep the step compute-bound.

Cluster numbers are datasheet peaks times a sustained fraction (stated per row): the model
predicts what an explicit schedule should reach and which term limits it, not a
measurement. "TFLOPS/GPU" follows the seed's convention (hardware FLOPs, recompute
included, as DeepSpeed's profiler counts them); model TFLOPS exclude the recompute.
"""

from __future__ import annotations

import fz3
from fz3.cost.estimate import Cluster, Workload, estimate

GiB = 2**30

# Sustained fraction of peak for large bf16/fp16 GEMM-dominated training (a common 50-60%).
SUSTAINED = 0.55
P3DN = Cluster(nodes=16, devices_per_node=8, flops=SUSTAINED * 125e12, peak_flops=125e12, mem_bw=0.9e12,
               memory=32 * GiB, intra_bw=130e9, inter_bw=100e9 / 8, intra_latency=8e-6, inter_latency=30e-6)
P4D = Cluster(nodes=4, devices_per_node=8, flops=SUSTAINED * 312e12, peak_flops=312e12, mem_bw=1.5e12,
              memory=40 * GiB, intra_bw=230e9, inter_bw=400e9 / 8, intra_latency=6e-6, inter_latency=20e-6)
H100_1024 = Cluster(nodes=128, devices_per_node=8, flops=SUSTAINED * 989e12, peak_flops=989e12, mem_bw=3.3e12,
                    memory=80 * GiB, intra_bw=370e9, inter_bw=8 * 50e9, intra_latency=5e-6, inter_latency=15e-6)

SEED = {"16 p3dn (128 V100)": (P3DN, 44.7, 19.5), "4 p4d (32 A100)": (P4D, 109, 44.5)}


def roberta_10b() -> str:
    work = Workload.transformer(layers=30, hidden=5120, ffn=20480, vocab=50265, seq=512, micro_batch=8,
                                positions=514, param_bytes=2, grad_bytes=4)
    rows = [f"RobertaForMaskedLM-10B ({work.params / 1e9:.1f}B parameters), seq 512, micro-batch 8 per GPU, "
            f"activation recompute (the seed's gradient checkpointing); sustained {SUSTAINED:.0%} of peak.", "",
            "| cluster | schedule | mesh (replicate x shard) | TFLOPS/GPU (seed's measure) | model TFLOPS | "
            "step s | exposed comm s | GiB/GPU | limited by | seed ZeRO-2 | seed ZeRO-3 |",
            "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for name, (cluster, z2, z3) in SEED.items():
        for label, policy, replicas in (
            ("fz3 ZeRO-3, prefetch 1", fz3.Policy(), 1),
            ("fz3 ZeRO-3, prefetch 2", fz3.Policy(prefetch=2), 1),
            ("fz3 hybrid (shard in node)", fz3.Policy(), cluster.nodes),
        ):
            shard = cluster.devices // replicas
            e = estimate(work, policy, cluster, shard=shard, replicas=replicas)
            fits = "" if e.memory_bytes <= cluster.memory else " (does not fit)"
            rows.append(f"| {name} | {label} | {replicas} x {shard} | {e.hardware_tflops:.1f} | {e.model_tflops:.1f} | "
                        f"{e.step_s:.2f} | {e.exposed_comm_s:.2f} | {e.memory_bytes / GiB:.1f}{fits} | {e.limiter} | "
                        f"{z2} | {z3} |")
    return "\n".join(rows)


def llama_70b() -> str:
    rows = ["Llama-70B-class (80 layers, hidden 8192, SwiGLU MLP 28672, grouped-query attention with 1024-wide "
            "K/V, vocab 128k), seq 4096, 1,024 H100 (128 nodes x 8, 400 Gb/s per GPU), activation recompute.", "",
            "| mesh (replicate x shard) | prefetch | micro-batch | tokens/GPU | step s | MFU | exposed comm s | "
            "GiB/GPU | limited by |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    c = H100_1024
    # Roofline rule: per-step compute per GPU (6 N tokens / flops) must exceed the time to move
    # the parameters (3 passes of N bytes-per-param over the bottleneck link); the token batch
    # per GPU must exceed (flops / bandwidth) x bytes-per-param / 2.
    for replicas, prefetch, mb in ((1, 1, 1), (1, 2, 1), (128, 1, 1), (64, 1, 1), (16, 1, 1), (16, 2, 2),
                                   (8, 2, 2)):
        work = Workload.transformer(layers=80, hidden=8192, ffn=28672, vocab=128256, seq=4096, micro_batch=mb,
                                    kv_dim=1024, gated=True, param_bytes=2, grad_bytes=4)
        shard = c.devices // replicas
        e = estimate(work, fz3.Policy(prefetch=prefetch), c, shard=shard, replicas=replicas)
        fits = "" if e.memory_bytes <= c.memory else " (does not fit)"
        rows.append(f"| {replicas} x {shard} | {prefetch} | {mb} | {mb * 4096} | {e.step_s:.2f} | {e.mfu:.2f} | "
                    f"{e.exposed_comm_s:.2f} | {e.memory_bytes / GiB:.0f}{fits} | {e.limiter} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(roberta_10b())
    print()
    print(llama_70b())
