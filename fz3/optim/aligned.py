"""A leaf's rows stepped by torch's fused AdamW kernel exactly as the whole leaf is, a unit at
a time (``fz3.train_step``).

On the CPU the kernel splits a tensor into tasks of 16 fp32 elements (one cache line) and
runs each task's vector loop, leaving the last ``numel % vector width`` elements of the tensor
to a scalar loop that rounds differently in the last bit (measured: ``exp_avg_sq`` of the
last elements of a row differs by 2e-9). Stepping a unit's rows as a tensor of their own
would put such a tail at every unit's end. So a unit steps, as one tensor, only its run of
whole 16-element chunks of the leaf (the leaf's own tail included, where its rows end the
leaf); a chunk it shares with a neighbouring unit is stepped when the second of them lands,
its gradient pieces (under 16 elements each) kept until then. The CUDA kernel has no such
tail: there every unit's rows are stepped as they come (``width`` 1).
"""

from __future__ import annotations

import torch

# the CPU kernel's task: 64 bytes of fp32, a multiple of any ``Vectorized<float>`` width
CHUNK = 16


def aligned(leaf: tuple[torch.Tensor, ...], grad: torch.Tensor, start: int,
            pending: dict[int, dict[int, torch.Tensor]], width: int) -> list[tuple]:
    """``(param, grad, mu, nu)`` runs of ``leaf`` (its param, mu and nu, contiguous) to step
    now, given the gradient ``grad`` of its flat elements ``[start, start + grad.numel())``;
    pieces of chunks still missing other elements wait in ``pending`` (chunk -> {first
    element: gradient piece})."""
    p, m, v = (t.view(-1) for t in leaf)
    g, total = grad.reshape(-1), p.numel()
    end = start + g.numel()
    lo = -(-start // width) * width
    hi = end if end == total else end // width * width
    out, pieces = [], []
    if lo < hi:
        out.append((p[lo:hi], g[lo - start:hi - start], m[lo:hi], v[lo:hi]))
        pieces = [(a, b) for a, b in ((start, lo), (hi, end)) if a < b]
    else:  # within at most two chunks, none of them whole
        cut = min(max(lo, start), end)
        pieces = [(a, b) for a, b in ((start, cut), (cut, end)) if a < b]
    for a, b in pieces:
        c = a // width
        got = pending.setdefault(c, {})
        got[a] = g[a - start:b - start].clone()
        first, last = c * width, min((c + 1) * width, total)
        if sum(t.numel() for t in got.values()) == last - first:
            del pending[c]
            gs = torch.cat([got[k] for k in sorted(got)])
            out.append((p[first:last], gs, m[first:last], v[first:last]))
    return out
