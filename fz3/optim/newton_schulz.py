"""Newton-Schulz orthogonalization of a batch of same-shape matrices in bf16, as
``torch.optim.Muon`` does for one (Keller Jordan's quintic iteration, torch 2.13's
``_zeropower_via_newtonschulz``):

    X <- G / max(||G||_F, eps)                      (the wide orientation: rows <= columns)
    repeat steps times:  A = X X^T ;  B = b A + c A A ;  X <- a X + B X

On the CPU the batched products (``baddbmm``) give torch's per-matrix result bit for bit
(checked by ``tests/test_muon.py``, which compares against ``torch.optim.Muon``).
"""

from __future__ import annotations

import torch


def orthogonalize(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """``g`` (n, rows, cols) bf16 -> the orthogonalized matrices (n, rows, cols) bf16 (a tall
    batch comes back as a transposed view)."""
    a, b, c = coefficients
    tall = g.shape[-2] > g.shape[-1]
    x = g.mT if tall else g
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


def flops(shape: tuple[int, int], steps: int) -> int:
    """Multiply-adds x2 of one matrix's orthogonalization: per step, with m = min(shape) and
    n = max(shape), X X^T (2 m^2 n), A A (2 m^3) and B X (2 m^2 n)."""
    m, n = min(shape), max(shape)
    return steps * (4 * m * m * n + 2 * m**3)
