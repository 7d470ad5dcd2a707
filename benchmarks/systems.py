"""The training systems the benchmarks compare, each built the same way on the same GPT.

Every builder returns a ``System``: ``forward_backward(batch) -> loss`` (a detached 0-d tensor)
and ``optimizer()`` (one update), timed apart; ``system(batch)`` runs both. Every system uses
the same optimizer implementation, torch's AdamW with ``fused=True`` (on the CPU too; fz3's
``fz3.optim.step(..., donate=True)`` calls the same fused kernel on its shards), with the
same hyperparameters and weight decay on matrices only. Models start from the same seed, so
after N steps on the same data every system's loss must agree (a benchmark of a wrong answer
is worthless).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from typing import Callable, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPT, GPTConfig

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
WD = 0.1


class System:
    """One training system: the step split into forward+backward and the optimizer."""

    def __init__(self, forward_backward: Callable[[tuple], torch.Tensor], optimizer: Callable[[], None]):
        self.forward_backward, self.optimizer = forward_backward, optimizer

    def __call__(self, batch) -> torch.Tensor:
        loss = self.forward_backward(batch)
        self.optimizer()
        return loss


def build(cfg: GPTConfig, device: torch.device, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    with torch.device(device):
        return GPT(cfg)


class Checkpointed(nn.Module):
    """Activation checkpointing of one block (recompute in backward), for like-for-like runs;
    ``sac``: torchtitan's per-op selective checkpointing instead (``create_selective_checkpoint_
    contexts``): the outputs of fz3's heavy ops (``fz3.schedule.ops.HEAVY_OPS``: matrix products,
    attention) saved, the rest recomputed, as fz3's ``selective`` keeps them."""

    def __init__(self, block: nn.Module, sac: bool = False):
        super().__init__()
        self.block, self.sac = block, sac

    def forward(self, *args, **kwargs):
        if not self.sac:
            return checkpoint(self.block, *args, use_reentrant=False, **kwargs)
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=_sac_context,
                          **kwargs)


def _sac_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy
    from fz3.schedule.ops import HEAVY_OPS

    name = op.overloadpacket.__name__ if hasattr(op, "overloadpacket") else str(op)
    return CheckpointPolicy.MUST_SAVE if name in HEAVY_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _sac_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_sac_policy)


def _wrap_blocks(model: GPT, ac: bool, compile_blocks: bool, sac: bool = False) -> None:
    """Activation checkpointing (``sac``: per-op selective) and/or ``torch.compile`` of each
    block (torchtitan's pattern)."""
    for i, b in enumerate(model.blocks):
        if compile_blocks:
            b = torch.compile(b)
        model.blocks[i] = Checkpointed(b, sac) if ac or sac else b


def _torch_adamw(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
                             **HP, fused=True)


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def _torch_system(wrapped: nn.Module, opt: torch.optim.Optimizer, device: torch.device,
                  dtype: torch.dtype | None) -> System:
    def forward_backward(batch):
        with _autocast(device, dtype):
            loss = wrapped(*batch)
        loss.backward()
        return loss.detach()

    def optimizer():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return System(forward_backward, optimizer)


def plain(cfg: GPTConfig, device: torch.device, *, ac: bool = False, dtype: torch.dtype | None = None,
          compile_blocks: bool = False, sac: bool = False, budget: float | None = None) -> System:
    """The unsharded model, plain autograd (autocast for mixed precision), no communication.
    ``budget``: the whole model under ``torch.compile`` with its min-cut rematerialisation at
    ``activation_memory_budget=budget`` (0: recompute all it can, 1: save all)."""
    model = build(cfg, device)
    _wrap_blocks(model, ac, compile_blocks, sac)
    if budget is None:
        return _torch_system(model, _torch_adamw(model), device, dtype)
    return _torch_system(torch.compile(model, backend=_budgeted(budget)), _torch_adamw(model),
                         device, dtype)


def _budgeted(budget: float):
    """Inductor with its min-cut rematerialisation at ``activation_memory_budget=budget``: a
    backend of its own per budget, so dynamo compiles again for each (its cache is shared by
    every instance of the model's class and guards on the backend, not on functorch's config:
    with one backend, every budget after the first reused the first one's programs)."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        with functorch_config.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs)

    return backend


def ddp(cfg: GPTConfig, device: torch.device, *, ac: bool = False, dtype: torch.dtype | None = None) -> System:
    from torch.nn.parallel import DistributedDataParallel

    model = build(cfg, device)
    _wrap_blocks(model, ac, False)
    wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return _torch_system(wrapped, _torch_adamw(model), device, dtype)


def fsdp2(cfg: GPTConfig, device: torch.device, *, ac: bool = False, dtype: torch.dtype | None = None,
          root_only: bool = False, compile_blocks: bool = False, sac: bool = False) -> System:
    """FSDP2. Default: ``fully_shard`` on every block and the root, reshard after forward.
    ``root_only``: one ``fully_shard`` on the root with ``reshard_after_forward=False`` (the
    whole model gathered once per step: fz3's whole-stack unit, like for like)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build(cfg, device)
    _wrap_blocks(model, ac, compile_blocks, sac)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    if not root_only:
        for block in model.blocks:
            fully_shard(block, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mp_policy=mp, reshard_after_forward=not root_only)
    return _torch_system(model, _torch_adamw(model), device, None)  # MixedPrecisionPolicy casts, no autocast


def fz3_system(cfg: GPTConfig, device: torch.device, *, policy: fz3.Policy = fz3.Policy(),
               dtype: torch.dtype | None = None, compile: bool = False, trace: bool = True) -> System:
    module = build(cfg, device)
    model, params = shard_gpt(module, device=device, precision=fz3.Precision(dtype, torch.float32 if dtype else None))
    del module
    opt = fz3.optim.adamw(**HP, weight_decay=WD, mask=fz3.decay_mask(model))
    value_and_grad = fz3.value_and_grad(model, policy, compile=compile, trace=trace)
    carry = {"params": params, "state": opt.init(params), "grads": None}

    def forward_backward(batch):
        loss, carry["grads"] = value_and_grad(carry["params"], batch)
        return loss

    def optimizer():  # torch's fused AdamW kernel, in place on the shards
        carry["params"], carry["state"] = fz3.optim.step(opt, carry["grads"], carry["state"], carry["params"],
                                                         donate=True)
        carry["grads"] = None

    return System(forward_backward, optimizer)


def ds_zero3_config() -> dict:
    """DeepSpeed's ZeRO-3 config for every benchmark: every parameter partitioned (no
    persistence threshold), communication overlapped, a client torch optimizer."""
    return {
        "train_micro_batch_size_per_gpu": 1,  # batch sizes are the caller's; only used for bookkeeping
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": True},
        "wall_clock_breakdown": False,
    }


def deepspeed_zero3(cfg: GPTConfig, device: torch.device, *, ac: bool = False,
                    dtype: torch.dtype | None = None) -> System:
    """DeepSpeed ZeRO-3 (CPU accelerator on gloo here), client torch AdamW, every parameter sharded."""
    import deepspeed

    model = build(cfg, device)
    _wrap_blocks(model, ac, False)
    config = ds_zero3_config()
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=_torch_adamw(model), config=config,
                                      dist_init_required=False)

    def forward_backward(batch):
        loss = engine(*batch)
        engine.backward(loss)
        return loss.detach()

    return System(forward_backward, engine.step)


def rank_batch(cfg: GPTConfig, per_rank: int, step: int, rank: int, device: torch.device):
    """The same synthetic batch stream for every system: (tokens, targets) (B, T) int64."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randint(0, cfg.vocab, (per_rank, cfg.seq + 1), generator=g)
    return x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)


PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16, datasheet


def flops_per_token(cfg: GPTConfig) -> float:
    """Model FLOPs (PaLM appendix B): 6 x matmul parameters + 12 L T d for attention scores."""
    matmul = cfg.layers * (4 + 2 * cfg.mlp_ratio) * cfg.dim ** 2 + cfg.vocab * cfg.dim
    return 6 * matmul + 12 * cfg.layers * cfg.seq * cfg.dim


def sync(device: torch.device) -> None:
    """Wait for the device (timing a step on a GPU); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize()


class Timed(NamedTuple):
    step: System
    build_s: float
    times: list[float]  # wall time of each timed step, device synchronized
    host: list[float]  # host time to issue each timed step (returns before the device is done)
    loss: torch.Tensor


def time_steps(make: Callable[[], System], cfg: GPTConfig, micro: int, device: torch.device,
               steps: int, warmup: int) -> Timed:
    """Build a system (``make()``, timed) with the allocator's peak reset, then run ``warmup`` +
    ``steps`` steps of rank 0's batch stream; the timed steps' wall and host times."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step = make()
    build = time.perf_counter() - t0
    times, host, loss = [], [], None
    for s in range(warmup + steps):
        b = rank_batch(cfg, micro, s, 0, device)
        sync(device)
        t0 = time.perf_counter()
        loss = step(b)
        issued = time.perf_counter() - t0  # the host returned: it issued the whole step
        sync(device)
        if s >= warmup:
            times.append(time.perf_counter() - t0)
            host.append(issued)
    return Timed(step, build, times, host, loss)


def median_time(fn: Callable[[], object], steps: int, warmup: int = 3,
                between: Callable[[], object] | None = None) -> float:
    """Median seconds of ``steps`` calls of ``fn`` after ``warmup`` untimed ones; ``between``,
    if given, runs untimed after each call (a training loop's optimizer step)."""
    ts = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            ts.append(time.perf_counter() - t0)
        if between is not None:
            between()
    return statistics.median(ts)

