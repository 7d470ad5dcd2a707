"""AdamW (Loshchilov & Hutter) on flat shards, matching ``torch.optim.AdamW``'s equations.

    m_t = b1 m + (1 - b1) g                  v_t = b2 v + (1 - b2) g^2
    p  <- p - lr wd mask p - (lr / (1 - b1^t)) m_t / (sqrt(v_t) / sqrt(1 - b2^t) + eps)

Elementwise, so it needs no communication: each rank updates its own shards. Padding stays
zero: its gradient, moments and parameters are all zero, so its update is zero.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable, NamedTuple

import optree
import torch
from torch.optim.adam import adam as _torch_adam

from .aligned import CHUNK, aligned
from .base import GradientTransformation, UnitStep, Tree
from .checks import FIX_STATE, check_like, check_mask


# torch >= 2.6 runs AdamW as Adam with decoupled weight decay; older torch has adamw's own
# functional.
_ADAM_HAS_DECOUPLED = "decoupled_weight_decay" in inspect.signature(_torch_adam).parameters


class AdamWState(NamedTuple):
    count: torch.Tensor  # () int64 on the CPU: steps taken (read without a device sync)
    mu: Tree  # first moments, shaped like params, fp32
    nu: Tree  # second moments


def adamw(lr: float | Callable[[int], float] = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
          eps: float = 1e-8, weight_decay: float = 1e-2,
          mask: Tree | None = None) -> GradientTransformation:
    """``lr`` may be a schedule ``step -> lr`` (step counts from 1). ``mask``: a pytree shaped like
    params of bool tensors (broadcasting against params' leaves), True where weight decay
    applies (see ``fz3.decay_mask``); None decays everything, as ``torch.optim.AdamW`` does."""
    b1, b2 = betas
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"betas={betas} must lie in [0, 1)")
    if (not callable(lr) and lr < 0) or eps < 0 or weight_decay < 0:
        raise ValueError(f"lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0")
    # Masks as 0/1 floats, once; they broadcast against the leaves (fz3.decay_mask gives the
    # layers' mask as one (1, shard) row shared by every layer). The fused path reads their
    # runs once, here.
    masks = None if mask is None else optree.tree_map(lambda m: m.to(torch.float32), mask)
    runs = None if masks is None else [_decay_runs(k) for k in optree.tree_leaves(masks)]

    def init(params: Tree) -> AdamWState:
        zeros = optree.tree_map(torch.zeros_like, params)
        return AdamWState(torch.zeros((), dtype=torch.int64), zeros,
                          optree.tree_map(torch.zeros_like, params))

    def update(grads: Tree, state: AdamWState,
               params: Tree | None = None) -> tuple[Tree, AdamWState]:
        if params is None and weight_decay:
            raise ValueError("adamw with weight_decay needs params: "
                             "opt.update(grads, state, params)")
        _check_buffers(grads, state, params, masks)
        count, t, rate = _tick(state, lr)
        leaf = functools.partial(_leaf_update, b1=b1, b2=b2, eps=eps, step_size=rate / (1 - b1**t),
                                 bc2_sqrt=math.sqrt(1 - b2**t), decay=rate * weight_decay)
        mus, treedef = optree.tree_flatten(state.mu)
        nus, gs = treedef.flatten_up_to(state.nu), treedef.flatten_up_to(grads)
        ps = treedef.flatten_up_to(params) if params is not None else [None] * len(mus)
        ks = treedef.flatten_up_to(masks) if masks is not None else [None] * len(mus)
        out = [leaf(*args) for args in zip(mus, nus, gs, ps, ks)]
        mu, nu, updates = (treedef.unflatten([o[i] for o in out]) for i in range(3))
        return updates, AdamWState(count, mu, nu)

    def update_inplace(grads: Tree, state: AdamWState, params: Tree) -> tuple[Tree, AdamWState]:
        """The same step through torch's fused Adam kernel, in place on params and moments:
        one call for the elements weight decay applies to and one for the others (the kernel
        takes one decay per call), so masked decay costs no pass of its own. Every buffer is
        checked against params first: the kernel trusts their sizes."""
        _check_buffers(grads, state, params, masks)
        count, t, rate = _tick(state, lr)
        ps, treedef = optree.tree_flatten(params)
        leaves = zip(ps, *(treedef.flatten_up_to(x) for x in (grads, state.mu, state.nu)))
        ks = treedef.flatten_up_to(masks) if masks is not None else [None] * len(ps)
        groups: dict[float, list] = {}
        for i, (tensors, keep) in enumerate(zip(leaves, ks)):
            for decay, run in _leaf_groups(tensors, runs and runs[i], keep, rate, weight_decay):
                groups.setdefault(decay, []).append(run or tensors)
        for decay, group in groups.items():
            _fused(group, t, lr=rate, beta1=b1, beta2=b2, weight_decay=decay, eps=eps)
        return params, AdamWState(count, state.mu, state.nu)

    per_unit = functools.partial(_per_unit, lr=lr, betas=betas, eps=eps,
                                weight_decay=weight_decay, masks=masks, runs=runs)
    return GradientTransformation(init, update, update_inplace, per_unit)


def _per_unit(state: AdamWState, params: Tree, *, lr, betas: tuple[float, float], eps: float,
             weight_decay: float, masks: Tree | None, runs: list | None) -> UnitStep:
    """``update_inplace``'s step a unit at a time, bit for bit (``aligned``): the count ticks
    here, once."""
    b1, b2 = betas
    _check_buffers(params, state, params, masks)
    count, t, rate = _tick(state, lr)
    ps, treedef = optree.tree_flatten(params)
    mus, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
    ks = treedef.flatten_up_to(masks) if masks is not None else [None] * len(ps)
    width = CHUNK if ps and ps[0].device.type == "cpu" else 1
    pending: list[dict] = [{} for _ in ps]

    def step_layers(i: int, layers: slice | None, grad: torch.Tensor) -> None:
        p, m, v = ps[i], mus[i], nus[i]
        own = p if layers is None else p[layers]
        if grad.shape != own.shape:
            raise ValueError(f"the gradient of layers {layers} of leaf {i} is "
                             f"{list(grad.shape)}, its parameters {list(own.shape)}")
        groups: dict[float, list] = {}
        start = 0 if layers is None else layers.start * own[0].numel()
        for decay, run in _leaf_groups((p, grad, m, v), runs and runs[i], ks[i], rate,
                                       weight_decay, layers):
            groups.setdefault(decay, []).extend(
                [run] if run else aligned((p, m, v), grad, start, pending[i], width))
        for decay, group in groups.items():
            _fused(group, t, lr=rate, beta1=b1, beta2=b2, weight_decay=decay, eps=eps)

    def finish() -> tuple[Tree, AdamWState]:
        left = [i for i, chunks in enumerate(pending) if chunks]
        if left:
            raise RuntimeError(f"adamw per unit: leaves {left} have elements never stepped "
                               f"this step (every layer takes one update a step)")
        return params, AdamWState(count, state.mu, state.nu)

    return UnitStep(step_layers, finish)


def _check_buffers(grads: Tree, state: Any, params: Tree | None, masks: Tree | None) -> None:
    """The state is adamw's, and its moments, the gradients and the mask match params (or the
    first moment, without params) leaf by leaf: the kernels trust their sizes."""
    if not isinstance(state, AdamWState):
        raise TypeError(f"the optimizer state is {type(state).__name__}, adamw's is an "
                        f"AdamWState: {FIX_STATE}")
    like = params if params is not None else state.mu
    check_like(like, state.mu, "the optimizer state's first moment (mu)", FIX_STATE)
    check_like(like, state.nu, "the optimizer state's second moment (nu)", FIX_STATE)
    check_like(like, grads, "the gradients", "pass the gradients of these params (the step "
               "function's grads for this model)")
    if masks is not None:
        check_mask(like, masks)


def _fused(group: list, t: int, **hyper: float) -> None:
    """torch's fused AdamW kernel, in place, on ``(param, grad, mu, nu)`` leaves: one call."""
    if group:
        p, g, m, v = (list(x) for x in zip(*group))
        # one step tensor per leaf (the kernel adds 1 to each): views of one buffer
        steps = list(torch.full((len(p),), float(t - 1), device=p[0].device).unbind())
        fused_adamw(p, g, m, v, steps, **hyper)


def _tick(state: AdamWState, lr: float | Callable[[int], float]) -> tuple[torch.Tensor, int, float]:
    """``(count, t, lr at t)`` for the step about to be taken; ``count`` is a CPU tensor, so
    reading it costs no device sync."""
    count = state.count + 1
    t = int(count)
    return count, t, lr(t) if callable(lr) else lr


def _leaf_update(m, v, g, p, keep, *, b1, b2, eps, step_size, bc2_sqrt, decay):
    """One leaf's ``(mu, nu, update)``, out of place. In-place only on tensors allocated here;
    the same operation order as torch.optim.AdamW's single-tensor path."""
    mu = torch.lerp(m, g, 1 - b1)
    nu = torch.mul(v, b2).addcmul_(g, g, value=1 - b2)
    u = nu.sqrt().div_(bc2_sqrt).add_(eps)
    torch.div(mu, u, out=u).mul_(-step_size)
    if decay:  # decoupled: -lr * wd * p, where the mask allows it
        if keep is None:
            u.add_(p, alpha=-decay)
        else:
            u.addcmul_(p, keep, value=-decay)
    return mu, nu, u


def fused_adamw(params, grads, mus, nus, steps, *, lr, beta1, beta2, weight_decay, eps) -> None:
    """torch's fused AdamW kernel through its functional API (CPU and CUDA)."""
    kw = dict(fused=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay,
              eps=eps, maximize=False)
    if _ADAM_HAS_DECOUPLED:
        _torch_adam(params, grads, mus, nus, [], steps, decoupled_weight_decay=True, **kw)
    else:  # torch < 2.6: AdamW's own functional
        from torch.optim.adamw import adamw as _torch_adamw

        _torch_adamw(params, grads, mus, nus, [], steps, **kw)


def _decay_runs(keep: torch.Tensor) -> list[list[tuple[int, int, bool]]]:
    """Per row of a mask (its last dimension; one row for ``fz3.decay_mask``'s ``(1, shard)``
    stack masks), its ``(start, stop, decays)`` runs: one small host read per row. A mask of
    no elements (a rank whose shard of a Muon stack's rest is empty) has no runs."""
    if keep.numel() == 0:
        return [[]]
    rows = keep.reshape(-1, keep.shape[-1] if keep.dim() else 1).bool()
    out = []
    for row in rows:
        cuts = [0, *((row[1:] != row[:-1]).nonzero().flatten() + 1).tolist(), row.numel()]
        flags = row[cuts[:-1]].tolist()
        out.append([(a, b, f) for a, b, f in zip(cuts, cuts[1:], flags)])
    return out


# A slice costs ~6 us of host time to build (4 views), a masked decay pass ~1 ns per element
# (2 cores here): below this many elements per slice the pass is cheaper (thin GPT rows: 2.6k,
# fat: 450k elements per slice).
SLICE_MIN_ELEMENTS = 8192


def _leaf_groups(tensors: tuple, mask_rows: list | None, keep: torch.Tensor | None, rate: float,
                 weight_decay: float, layers: slice | None = None) -> list[tuple[float, Any]]:
    """``[(decay, run)]`` for one leaf's ``(p, g, m, v)`` (``g`` its ``layers``' gradient;
    ``layers`` None: the whole leaf), decided on the whole leaf's mask: ``run`` None steps
    those layers whole (after the masked decay applied in a pass of its own, where the mask is
    mixed and its slices small); else contiguous slices of each row, one per run of the mask
    where they are large (the fused kernel takes one decay per call and contiguous tensors)."""
    if mask_rows is None or not weight_decay or tensors[0].numel() == 0:
        return [(weight_decay, None)]
    flags = {f for row in mask_rows for _, _, f in row}
    if len(flags) == 1:  # uniform
        return [(weight_decay if flags.pop() else 0.0, None)]
    p, g, m, v = tensors
    n = p.shape[-1]
    per_row = max(len(row) for row in mask_rows)
    if n < SLICE_MIN_ELEMENTS * per_row or keep.shape[-1] != n:
        mine = p if layers is None else p[layers]
        by_layer = layers is not None and keep.dim() == p.dim() and keep.shape[0] == p.shape[0] > 1
        mine.addcmul_(mine, keep[layers] if by_layer else keep, value=-rate * weight_decay)
        return [(0.0, None)]  # decoupled, before the step
    out, first = [], 0 if layers is None else layers.start
    flat = [t.view(-1, n) for t in ((p, g, m, v) if layers is None else
                                    (p[layers], g, m[layers], v[layers]))]
    for r in range(flat[0].shape[0]):  # a mask of one row serves every row
        for a, b, decays in mask_rows[first + r if len(mask_rows) > 1 else 0]:
            out.append((weight_decay if decays else 0.0, tuple(x[r, a:b] for x in flat)))
    return out
