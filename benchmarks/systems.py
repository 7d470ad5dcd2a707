"""The training systems the benchmarks compare, each built the same way on the same GPT.

Every builder returns ``step(batch) -> loss`` (a detached 0-d tensor) that runs one full
training step: forward, backward, AdamW update (lr, betas, weight decay on matrices only:
identical hyperparameters everywhere). Models start from the same seed, so after N steps
on the same data every system's loss must agree (a benchmark of a wrong answer is worthless).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import fz3
from fz3.models.gpt import GPT, GPTConfig
from fz3.models import shard_gpt

Step = Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]
HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
WD = 0.1


def build(cfg: GPTConfig, device: torch.device, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    with torch.device(device):
        return GPT(cfg)


class Checkpointed(nn.Module):
    """Activation checkpointing of one block (recompute in backward), for like-for-like runs."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def _checkpoint_blocks(model: GPT) -> None:
    for i, b in enumerate(model.blocks):
        model.blocks[i] = Checkpointed(b)


def _torch_adamw(model: nn.Module, fused: bool | None = None) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
                             **HP, fused=fused)


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def plain(cfg: GPTConfig, device: torch.device, *, ac: bool = False, dtype: torch.dtype | None = None) -> Step:
    """The unsharded model, plain autograd (autocast for mixed precision), no communication."""
    model = build(cfg, device)
    if ac:
        _checkpoint_blocks(model)
    opt = _torch_adamw(model, fused=True if device.type == "cuda" else None)

    def step(batch):
        with _autocast(device, dtype):
            loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def ddp(cfg: GPTConfig, device: torch.device, *, ac: bool = False, dtype: torch.dtype | None = None) -> Step:
    from torch.nn.parallel import DistributedDataParallel

    model = build(cfg, device)
    if ac:
        _checkpoint_blocks(model)
    wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = _torch_adamw(model)

    def step(batch):
        with _autocast(device, dtype):
            loss = wrapped(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def fsdp2(cfg: GPTConfig, device: torch.device, *, ac: bool = False, dtype: torch.dtype | None = None,
          prefetch: bool = False) -> Step:
    """FSDP2: ``fully_shard`` on every block and the root, reshard after forward."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build(cfg, device)
    if ac:
        _checkpoint_blocks(model)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mp_policy=mp)
    if prefetch:  # explicit prefetch: the next block in forward, the previous one in backward
        blocks = list(model.blocks)
        for i, b in enumerate(blocks):
            if i + 1 < len(blocks):
                b.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                b.set_modules_to_backward_prefetch([blocks[i - 1]])
    opt = _torch_adamw(model)

    def step(batch):
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def fz3_system(cfg: GPTConfig, device: torch.device, *, policy: fz3.Policy = fz3.Policy(),
               dtype: torch.dtype | None = None) -> Step:
    module = build(cfg, device)
    model, params = shard_gpt(module, device=device,
                              precision=fz3.Precision(dtype, torch.float32 if dtype else None))
    del module
    opt = fz3.optim.adamw(**HP, weight_decay=WD, mask=fz3.decay_mask(model))
    value_and_grad = fz3.value_and_grad(model, policy)
    carry = [params, opt.init(params)]

    def step(batch):
        params, state = carry
        loss, grads = value_and_grad(params, batch)
        carry[:] = fz3.optim.step(opt, grads, state, params, donate=True)  # fused, in place
        return loss

    return step


def deepspeed_zero3(cfg: GPTConfig, device: torch.device, *, ac: bool = False, dtype: torch.dtype | None = None) -> Step:
    """DeepSpeed ZeRO-3 (CPU accelerator on gloo here), client torch AdamW, every parameter sharded."""
    import deepspeed

    model = build(cfg, device)
    if ac:
        _checkpoint_blocks(model)
    config = {
        "train_micro_batch_size_per_gpu": 1,  # batch sizes are the caller's; only used for bookkeeping
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": True},
        "wall_clock_breakdown": False,
    }
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=_torch_adamw(model), config=config,
                                      dist_init_required=False)

    def step(batch):
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


def rank_batch(cfg: GPTConfig, per_rank: int, step: int, rank: int, device: torch.device):
    """The same synthetic batch stream for every system: (tokens, targets) (B, T) int64."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randint(0, cfg.vocab, (per_rank, cfg.seq + 1), generator=g)
    return x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()
