"""Between save and recompute: fz3's ``selective`` and its budget planner against per-op SAC.

    python benchmarks/selective.py                       # thin, fat, gpt256, llama
    python benchmarks/selective.py --configs gpt256 --compiled   # + torch.compile budgets

One process, world size 1 (gloo), one thread, CPU. For every system: forward+backward and
optimizer times (medians over ``--repeats`` interleaved rounds of ``--steps`` steps, every
system once per round, so drift hits all alike), and the peak live tensor bytes of one
forward+backward beyond what was alive before it (``fz3.observe.live_bytes.LiveBytes``), and
that peak beyond its family's recompute twin (the activations a policy keeps):

- fz3 ``recompute``, ``selective``, ``save``, and ``fz3.plan(memory=...)`` at five budgets
  between recompute's and save's planned peaks (``plan f=0.5``: halfway);
- plain PyTorch: full activation checkpointing (AC), torchtitan-style per-op SAC
  (``create_selective_checkpoint_contexts``, saving the ops fz3's ``selective`` keeps),
  nothing; FSDP2 the same three;
- ``mixed``: a fat part whose activations selective recompute keeps as save does and a thin
  part (``Mixed``), fz3's fixed policies against the planner (where mixing must win);
- ``--compiled``: plain under ``torch.compile`` with ``activation_memory_budget`` at the same
  five fractions.

Every system uses torch's AdamW with ``fused=True`` (``systems.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import compare  # noqa: E402
import fz3  # noqa: E402
import systems  # noqa: E402
from fz3.models import shard_gpt  # noqa: E402
from fz3.models.gpt import GPTConfig  # noqa: E402
from fz3.observe.live_bytes import LiveBytes  # noqa: E402
from fz3.schedule.saveable import name_of  # noqa: E402

CONFIGS = {**compare.CONFIGS,  # thin and fat
           "gpt256": dict(vocab=256, seq=256, dim=256, heads=4, layers=4, batch=8)}  # the demo
LLAMA = dict(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
LLAMA_SEQ, LLAMA_BATCH = 256, 4
FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)
MiB = 2**20


def gpt_systems(cfg: GPTConfig, batch: int, compiled: bool) -> dict:
    cpu = torch.device("cpu")
    out = {f"fz3 {a}": lambda a=a: systems.fz3_system(cfg, cpu, policy=fz3.Policy(activations=a))
           for a in ("recompute", "selective", "save")}
    out.update({f"fz3 {a} joined": lambda a=a: systems.fz3_system(
        cfg, cpu, policy=fz3.Policy(activations=a, join_grads=True))
        for a in ("recompute", "selective")})
    out.update({"plain + AC": lambda: systems.plain(cfg, cpu, ac=True),
                "plain + SAC": lambda: systems.plain(cfg, cpu, sac=True),
                "plain": lambda: systems.plain(cfg, cpu),
                "FSDP2 + AC": lambda: systems.fsdp2(cfg, cpu, ac=True),
                "FSDP2 + SAC": lambda: systems.fsdp2(cfg, cpu, sac=True),
                "FSDP2": lambda: systems.fsdp2(cfg, cpu)})
    if compiled:
        out.update({f"plain compiled budget={f}": lambda f=f: systems.plain(cfg, cpu, budget=f)
                    for f in FRACTIONS})
    return out


def _llama():
    import transformers as tf

    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA, pad_token_id=0, bos_token_id=1,
                                              eos_token_id=2, attn_implementation="sdpa"))


def _llama_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(3, LLAMA["vocab_size"], (LLAMA_BATCH, LLAMA_SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _fz3_of(sharded, policy) -> systems.System:
    """An fz3 step and fused AdamW on a sharded model (``systems.fz3_system``, any model)."""
    model, params = sharded
    opt = fz3.optim.adamw(**systems.HP, weight_decay=systems.WD, mask=fz3.decay_mask(model))
    step = fz3.value_and_grad(model, policy)
    carry = {"params": params, "state": opt.init(params), "grads": None}

    def forward_backward(batch):
        loss, carry["grads"] = step(carry["params"], batch)
        return loss

    def optimizer():
        carry["params"], carry["state"] = fz3.optim.step(opt, carry["grads"], carry["state"],
                                                         carry["params"], donate=True)
        carry["grads"] = None

    return systems.System(forward_backward, optimizer)


def _fz3_hf(policy) -> systems.System:
    return _fz3_of(fz3.shard(_llama()), policy)


def _torch_hf(ac: bool = False, sac: bool = False, fsdp: bool = False) -> systems.System:
    module = _llama()
    layers = module.model.layers
    for i, layer in enumerate(layers):
        layers[i] = systems.Checkpointed(layer, sac) if ac or sac else layer
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer)
        fully_shard(module)
    opt = systems._torch_adamw(module)

    def forward_backward(batch):
        loss = module(**batch).loss
        loss.backward()
        return loss.detach()

    def optimizer():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return systems.System(forward_backward, optimizer)


def llama_systems() -> dict:
    out = {f"fz3 {a}": lambda a=a: _fz3_hf(fz3.Policy(activations=a))
           for a in ("recompute", "selective", "save")}
    out.update({"plain + AC": lambda: _torch_hf(ac=True), "plain + SAC": lambda: _torch_hf(sac=True),
                "plain": lambda: _torch_hf(), "FSDP2 + AC": lambda: _torch_hf(ac=True, fsdp=True),
                "FSDP2 + SAC": lambda: _torch_hf(sac=True, fsdp=True),
                "FSDP2": lambda: _torch_hf(fsdp=True)})
    return out


def planned_llama() -> dict:
    return _budgets(fz3.shard(_llama()), _llama_batch(0), _fz3_hf)


class Mlp(torch.nn.Module):
    """A pre-norm MLP block of width ``dim`` expanded ``ratio`` times: its activations (what
    save keeps) grow with ``ratio``, its per-layer host cost does not."""

    def __init__(self, dim: int, ratio: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up, self.down = torch.nn.Linear(dim, ratio * dim), torch.nn.Linear(ratio * dim, dim)

    def forward(self, h):
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class Wide(torch.nn.Module):
    """Two matrix products through a 16x wider middle and nothing else: what ``save`` keeps
    (the middle, the input of the second product) is what ``selective`` keeps too."""

    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(dim, 16 * dim), torch.nn.Linear(16 * dim, dim)

    def forward(self, h):
        return h + self.down(self.up(h))


class Mixed(torch.nn.Module):
    """A fat part (``wide``: 4 ``Wide`` layers, big activations that selective recompute keeps
    as save does) and a thin part (``narrow``: 8 MLP blocks expanded 2x) over the same h: at a
    budget below selective's peak, saving the thin part only is faster than any one policy
    that fits."""

    def __init__(self, vocab=256, dim=128):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.wide = torch.nn.ModuleList(Wide(dim) for _ in range(4))
        self.narrow = torch.nn.ModuleList(Mlp(dim, 2) for _ in range(8))
        self.head = torch.nn.Linear(dim, vocab)


def _mixed_pre(m, b):
    return m.emb(b[0])


def _mixed_post(m, h, b):
    return torch.nn.functional.cross_entropy(m.head(h).flatten(0, 1), b[1].flatten())


def _mixed_batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 256, (8, 129), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _fz3_mixed(policy) -> systems.System:
    torch.manual_seed(0)
    return _fz3_of(fz3.shard(Mixed(), ["wide", "narrow"], _mixed_pre, _mixed_post), policy)


def mixed_systems() -> dict:
    """fz3 only: every fixed policy, then the planner (``planned_mixed``)."""
    return {f"fz3 {a}": lambda a=a: _fz3_mixed(fz3.Policy(activations=a))
            for a in ("recompute", "selective", "save")}


def planned_mixed() -> dict:
    torch.manual_seed(0)
    return _budgets(fz3.shard(Mixed(), ["wide", "narrow"], _mixed_pre, _mixed_post),
                    _mixed_batch(0), _fz3_mixed)


def _budgets(sharded, b, make) -> dict:
    """``fz3.plan(memory=...)`` at five budgets between recompute's and save's planned peaks;
    each row says what it chose and which fixed policies' planned peaks fit that budget."""
    model, params = sharded
    peak = {a: fz3.memory_plan(model, fz3.plan(model, fz3.Policy(activations=a)), b).peak
            for a in ("recompute", "selective", "save")}
    out = {}
    for f in FRACTIONS:
        budget = int(peak["recompute"] + f * (peak["save"] - peak["recompute"]))
        sched = fz3.plan(model, memory=budget, batch=b, params=params)
        fixed = [a for a in ("recompute", "selective", "save") if peak[a] <= budget]
        out[f"fz3 plan f={f}"] = (lambda s=sched: make(s), budget,
                                  f"{_kinds(sched)}; fixed that fit: {', '.join(fixed)}")
    return out


def _kinds(sched) -> str:
    """The predicates the layer units' forwards carry."""
    return ", ".join(sorted({name_of(op.saves) for op in sched.ops if op.saves is not None
                             and sched.units[op.unit].role is fz3.Role.STACK}))


def planned(cfg: GPTConfig, batch: int) -> dict:
    cpu = torch.device("cpu")
    return _budgets(shard_gpt(systems.build(cfg, cpu)), systems.rank_batch(cfg, batch, 0, 0, cpu),
                    lambda s: systems.fz3_system(cfg, cpu, policy=s))


def measure(make, batch_of, steps: int, live_bytes: bool = True) -> dict:
    """``live_bytes=False``: no live-bytes peak (a compiled model under ``LiveBytes``, a
    dispatch mode, runs eagerly: its peak would be eager's); the allocator's peak is measured
    for every system."""
    system = make()
    for s in range(2):  # warm: traces, compiles, optimizer state
        system.forward_backward(batch_of(s))
        system.optimizer()
    peak = None
    if live_bytes:
        with LiveBytes() as live:
            before = live.now
            system.forward_backward(batch_of(2))
        system.optimizer()
        peak = live.peak - before
    alloc = allocator_peak(lambda: system.forward_backward(batch_of(2)))
    system.optimizer()
    return dict(system=system, peak=peak, alloc=alloc, fb=[], opt=[])


def allocator_peak(fn) -> int:
    """The peak of the CPU allocator's bytes while ``fn`` runs beyond those alive at its start,
    from torch's memory profiler timeline (every allocation, kernels' temporaries included, and
    whatever dispatch path runs: compiled code too). Through ``export_memory_timeline``, the
    profiler's public export (deprecated in torch 2.13, still there): one point per timestamp,
    the bytes by category; the first point is what was alive before."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "timeline.json")
        prof.export_memory_timeline(path, device="cpu")
        with open(path) as f:
            _, sizes = json.load(f)
    totals = [sum(point) for point in sizes]
    return max(totals) - totals[0] if totals else 0


def time_round(m: dict, batch_of, steps: int) -> None:
    for s in range(steps):
        b = batch_of(3 + s)
        t0 = time.perf_counter()
        m["system"].forward_backward(b)
        t1 = time.perf_counter()
        m["system"].optimizer()
        m["fb"].append(t1 - t0)
        m["opt"].append(time.perf_counter() - t1)


def run_config(name: str, args) -> list[str]:
    plans = not args.systems or "fz3 plan" in args.systems  # the planner's timed steps: minutes
    if name == "llama":
        makers = {k: (v, None, "") for k, v in llama_systems().items()}
        makers.update(planned_llama() if plans else {})
        batch_of = _llama_batch
    elif name == "mixed":
        makers = {k: (v, None, "") for k, v in mixed_systems().items()}
        makers.update(planned_mixed() if plans else {})
        batch_of = _mixed_batch
    else:
        c = dict(CONFIGS[name])
        batch = c.pop("batch")
        cfg = GPTConfig(**c)
        makers = {k: (v, None, "") for k, v in gpt_systems(cfg, batch, args.compiled).items()}
        makers.update(planned(cfg, batch) if plans else {})
        batch_of = lambda s: systems.rank_batch(cfg, batch, s, 0, torch.device("cpu"))  # noqa: E731
    if args.systems:
        makers = {k: v for k, v in makers.items() if k in args.systems.split(",")}
    results, failed = {}, []
    for k, (make, _, _) in makers.items():
        try:
            results[k] = measure(make, batch_of, args.steps, live_bytes="compiled" not in k)
        except Exception as e:  # noqa: BLE001 - a system that cannot run is reported, not fatal
            failed.append(f"- {k} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    for _ in range(args.repeats):
        for m in results.values():
            time_round(m, batch_of, args.steps)
    return table(name, results, makers) + failed + ([""] if failed else [])


def table(name: str, results: dict, makers: dict) -> list[str]:
    twins = {"fz3": "fz3 recompute", "plain": "plain + AC", "FSDP2": "FSDP2 + AC"}
    save = {"fz3": "fz3 save", "plain": "plain", "FSDP2": "FSDP2"}
    lines = [f"### {name}", "", "| system | fwd+bwd ms | optimizer ms | peak live MiB | allocator "
             "peak MiB | kept beyond recompute MiB | kept / save's | budget MiB (chosen) |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for k, m in results.items():
        family = k.split()[0]
        base = results[twins[family]]["peak"] if twins.get(family) in results else None
        full = (results[save[family]]["peak"] - base
                if base is not None and save.get(family) in results else None)
        kept = m["peak"] - base if base is not None and m["peak"] is not None else None
        ratio = f"{kept / full:.2f}" if kept is not None and full else "-"
        _, budget, chosen = makers[k]
        peak = "n/a" if m["peak"] is None else f"{m['peak'] / MiB:.1f}"
        kept_mib = "-" if kept is None else f"{kept / MiB:.1f}"
        planned = "-" if budget is None else f"{budget / MiB:.1f} ({chosen})"
        lines.append(f"| {k} | {statistics.median(m['fb']) * 1e3:.1f} | "
                     f"{statistics.median(m['opt']) * 1e3:.1f} | {peak} | "
                     f"{m['alloc'] / MiB:.1f} | {kept_mib} | {ratio} | "
                     f"{planned} |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="thin,fat,gpt256,llama,mixed")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per system and round")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--compiled", action="store_true")
    ap.add_argument("--systems", default="", help="comma-separated system names (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    print(f"torch {torch.__version__}, world size 1, {args.repeats} interleaved rounds of "
          f"{args.steps} steps\n")
    for name in args.configs.split(","):
        print("\n".join(run_config(name, args)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
