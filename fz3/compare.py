"""How ranks and models are compared: one digest, and one way to name the first difference."""

from __future__ import annotations

import hashlib
from typing import Sequence, TypeVar

T = TypeVar("T")


def fingerprint(value: object) -> bytes:
    """8 bytes of SHA-256 over ``repr(value)``: equal on ranks that hold equal values (build
    ``value`` from plain Python data whose ``repr`` is deterministic)."""
    return hashlib.sha256(repr(value).encode()).digest()[:8]


def first_difference(a: Sequence[T], b: Sequence[T]) -> tuple[int, T | None, T | None] | None:
    """``(index, a's entry, b's entry)`` at the first position where they differ (None past
    the end of the shorter one); None when equal."""
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        if x != y:
            return i, x, y
    return None
