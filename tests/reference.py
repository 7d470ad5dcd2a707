"""Plain PyTorch references and comparisons used inside ranks."""

from __future__ import annotations

import contextlib
import copy
import logging

import torch

import fz3
from fz3.models.gpt import GPT, GPTConfig, synthetic_batch

RTOL, ATOL = 1e-5, 1e-6  # fp32 equality (DEVELOPERS.md)


@contextlib.contextmanager
def fz3_said(level: int = logging.INFO):
    """The messages the ``fz3`` logger emits at ``level`` and above inside the block (a list,
    filled as they come; the logger's level restored after)."""
    said: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("fz3")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(level)
    try:
        yield said
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def gpt(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def batches(cfg: GPTConfig, world: int, per_rank: int = 2, step: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch per rank; the reference sees their concatenation."""
    return [synthetic_batch(cfg, per_rank, seed=1000 * step + r) for r in range(world)]


def concat(bs):
    return tuple(torch.cat(parts) for parts in zip(*bs))


def reference_grads(module: torch.nn.Module, bs) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of plain autograd on the unsharded module over all ranks' batches."""
    m = copy.deepcopy(module)
    loss = m(*concat(bs))
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in m.named_parameters(remove_duplicate=False)}


def low_precision_grads(module: torch.nn.Module, bs, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What fz3 computes with ``Precision(dtype, torch.float32)``, done in plain autograd: each
    rank's batch through the module cast to ``dtype``, the gradients of the mean loss summed
    over ranks in fp32. Only the order of that sum can differ from fz3's."""
    total: dict[str, torch.Tensor] = {}
    for b in bs:
        m = copy.deepcopy(module).to(dtype)
        (m(*b) / len(bs)).backward()
        for n, p in m.named_parameters(remove_duplicate=False):
            total[n] = total[n] + p.grad.float() if n in total else p.grad.float()
    return total


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol=RTOL, atol=ATOL, what="") -> None:
    assert set(got) == set(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=rtol, atol=atol, msg=lambda m: f"{what} {n}: {m}")


def assert_rank_mean(got, local: float, rtol: float = 1e-5) -> None:
    """``got`` (fz3's loss: the mean over ranks) equals the mean over ranks of each rank's
    ``local`` reference loss on its own batch. Every rank must call it (an all-reduce)."""
    total = torch.tensor([float(local)])
    torch.distributed.all_reduce(total)
    want = float(total) / torch.distributed.get_world_size()
    torch.testing.assert_close(float(got), want, rtol=rtol, atol=0)


def assert_rel_norm(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float, what="") -> None:
    for n in want:
        rel = float((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-30))
        assert rel <= tol, f"{what} {n}: relative norm error {rel:.3g} > {tol}"


def sharded_grads(model, grads) -> dict[str, torch.Tensor] | None:
    return fz3.full_state_dict(model, grads)


def padding_is_zero(model, tree, rank: int) -> bool:
    """Every part's padding (the tail of the last ranks' shards) is zero in ``tree``."""
    for part, t in zip(model.parts, tree.parts):
        n = part.layout.shard_numel
        start = part.layout.numel - rank * n
        if start < n and t.reshape(part.rows, n)[:, max(start, 0):].any():
            return False
    return True


def clone(tree):
    """A copy of a Params-shaped tree (new buffers)."""
    import optree

    return optree.tree_map(torch.Tensor.clone, tree)


class LayerNet(torch.nn.Module):
    """Embedding, a stack of the given layers (``layers``: width 6), a head over 11 tokens:
    for tests of what a layer may do (``shard(LayerNet(...), "layers", layer_pre, layer_post)``)."""

    def __init__(self, layers):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.layers = torch.nn.ModuleList(layers)
        self.head = torch.nn.Linear(6, 11)


def layer_pre(m, b):
    return m.emb(b[0])


def layer_post(m, h, b):
    return torch.nn.functional.cross_entropy(m.head(h).flatten(0, 1), b[1].flatten())


def time_major_pre(m, b):
    """``layer_pre`` embedding time-major, h handed on as its transposed view: (B, T, 6)
    with strides (6, B*6, 1)."""
    return m.emb(b[0].t()).transpose(0, 1)


def time_major_post(m, h, b):
    """``layer_post`` reading h time-major: its gradient w.r.t. h is a transposed view."""
    return torch.nn.functional.cross_entropy(m.head(h.transpose(0, 1)).flatten(0, 1),
                                             b[1].t().flatten())


def layer_net_plain(net, b, pre=layer_pre, post=layer_post, aux: bool = False):
    """Loss and gradients of plain autograd on the unsharded ``LayerNet`` (a copy). ``aux``:
    its layers return ``(h, aux)``, and ``post`` takes their aux stacked, as fz3's one stack's
    (``layer_aux=True``)."""
    m = copy.deepcopy(net)
    h, auxes = pre(m, b), []
    for layer in m.layers:
        h = layer(h)
        if aux:
            h, a = h
            auxes.append(a)
    loss = post(m, h, b, (torch.stack(auxes),)) if aux else post(m, h, b)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in m.named_parameters()}
