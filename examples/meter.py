"""A rate for people: the first step, which traces the layers (and compiles them with
``compile=True``), is timed apart and left out of the steady rate."""

from __future__ import annotations

import time


class Meter:
    """``tick(items)`` after each step; ``rate()``: items per second since the first step
    ended (None before the second); ``first_s``: the first step's seconds."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.first_s: float | None = None
        self.t_steady = self.items = 0.0

    def tick(self, items: float) -> None:
        now = time.perf_counter()
        if self.first_s is None:
            self.first_s, self.t_steady = now - self.t0, now
        else:
            self.items += items
        self.now = now

    def rate(self) -> float | None:
        return None if not self.items else self.items / (self.now - self.t_steady)

    def line(self, unit: str) -> str:
        """``"5432 tokens/s"`` once steady, else what the first step took."""
        rate = self.rate()
        if rate is None:
            return f"first step {self.first_s:.2f} s (traces the layers; not in the rate)"
        return f"{rate:9.0f} {unit}/s"
