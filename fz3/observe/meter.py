"""``fz3.Meter``: what a training loop reports to people: the first step's time apart (it traces
the layers, and compiles them with ``compile=True``), the steady step time, tokens per second,
peak memory, and model FLOPs utilisation when told the FLOPs a token costs.

    meter = fz3.Meter(flops_per_token=6 * n_params, peak_flops=989e12)  # both optional
    for batch in batches:
        loss, grads = step(params, batch)
        ...
        meter.tick(tokens)              # this rank's tokens, or the job's: the rate follows
        log.info("step %d loss %.4f %s", i, float(loss), meter.line("tokens"))

Local: it reads the host clock only, nothing on the device, no collective. Time a rank waits for
the device is counted where the loop reads a device value (``float(loss)``), as any wall clock.
"""

from __future__ import annotations

import resource
import sys
import time

import torch

MiB = 2**20


class Meter:
    """``tick(items)`` after each step. ``first_s``: the first step's seconds (None before it);
    ``step_s``: the mean steady step since the first ended; ``rate()``: items per second since
    the first step ended (None before the second); ``peak_bytes()``: this process's peak
    memory; ``mfu()``: with ``flops_per_token`` and ``peak_flops``, the model FLOPs rate over
    ``peak_flops`` (per device: pass the rate of the items this process counts)."""

    def __init__(self, *, flops_per_token: float | None = None, peak_flops: float | None = None,
                 device: torch.device | str | None = None) -> None:
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.device = torch.device(device) if device is not None else None
        self.t0 = self.now = time.perf_counter()
        self.first_s: float | None = None
        self.t_steady = 0.0
        self.items = 0.0
        self.steps = 0  # steady steps

    def tick(self, items: float) -> None:
        now = time.perf_counter()
        if self.first_s is None:
            self.first_s, self.t_steady = now - self.t0, now
        else:
            self.items += items
            self.steps += 1
        self.now = now

    @property
    def step_s(self) -> float | None:
        return (self.now - self.t_steady) / self.steps if self.steps else None

    def rate(self) -> float | None:
        return self.items / (self.now - self.t_steady) if self.steps else None

    def peak_bytes(self) -> int:
        """The CUDA allocator's peak on ``device`` (read, never reset: the user's statistics
        stay theirs), else this process's peak resident set (``getrusage``)."""
        if self.device is not None and self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux

    def mfu(self) -> float | None:
        rate = self.rate()
        if rate is None or not self.flops_per_token or not self.peak_flops:
            return None
        return rate * self.flops_per_token / self.peak_flops

    def line(self, unit: str = "tokens") -> str:
        """``"5432 tokens/s  12.3 ms/step  peak 380 MiB"`` (and ``MFU 0.41``, or ``1.2 TFLOP/s``
        without ``peak_flops``) once steady, else what the first step took."""
        rate = self.rate()
        if rate is None:
            return f"first step {self.first_s or 0.0:.2f} s (traces the layers; not in the rate)"
        out = (f"{rate:9.0f} {unit}/s  {self.step_s * 1e3:.1f} ms/step  "
               f"peak {self.peak_bytes() / MiB:.0f} MiB")
        if self.flops_per_token and self.peak_flops:
            out += f"  MFU {self.mfu():.2f}"
        elif self.flops_per_token:
            out += f"  {rate * self.flops_per_token / 1e12:.2f} TFLOP/s"
        return out
