"""Progress of a long, local piece of work (reading ``weights=``, ``fz3.export``, ``fz3.save``
and ``fz3.load``), shown by global rank 0 only once the work has run ``after`` seconds: a short
load stays silent.

With tqdm installed (Hugging Face's choice; never a dependency of fz3) and stderr a terminal,
a tqdm bar; otherwise (no tqdm, or output to a log file) one INFO line on the ``fz3`` logger
per ``every`` seconds and one at the end: no carriage returns in a log. Nothing here is a
collective or reads a device value.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from .say import once

log = logging.getLogger(__name__)
MiB = 2**20


class Progress:
    """``with Progress("fz3.export", total=nbytes) as p: ... p.advance(nbytes_done_now)``.
    ``total`` (bytes) may be None when unknown."""

    def __init__(self, what: str, total: int | None = None, *, after: float = 2.0,
                 every: float = 10.0) -> None:
        self.what, self.total, self.after, self.every = what, total, after, every
        self.done = 0
        self.t0 = self._last = time.perf_counter()
        self._bar: Any = None
        self._said = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        elif self._bar is not None:
            self._bar.close()

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if now - self.t0 < self.after:
            return
        if self._bar is None and not self._said and _tty():
            self._bar = _tqdm(self.what, self.total)
            if self._bar is not None:
                self._bar.update(self.done / MiB)
                return
        if self._bar is not None:
            self._bar.update(nbytes / MiB)
        elif now - self._last >= self.every or not self._said:
            self._last, self._said = now, True
            once(log, logging.INFO, "%s: %s", self.what, self._line(now))

    def close(self) -> None:
        """The bar closed, or the last line, if the work ran ``after`` seconds or more (work
        done in one call, a DCP save, sets ``done`` and says only this)."""
        if self._bar is not None:
            self._bar.close()
        elif self._said or time.perf_counter() - self.t0 >= self.after:
            once(log, logging.INFO, "%s: done, %s", self.what, self._line(time.perf_counter()))

    def _line(self, now: float) -> str:
        of = f" of {self.total / MiB:.0f}" if self.total else ""
        return (f"{self.done / MiB:.0f}{of} MiB in {now - self.t0:.0f} s "
                f"({self.done / MiB / max(now - self.t0, 1e-9):.0f} MiB/s)")


def _tty() -> bool:
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


def _tqdm(what: str, total: int | None) -> Any:
    """A tqdm bar on rank 0 (None elsewhere, or without tqdm)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(desc=what, total=None if total is None else total / MiB, unit="MiB",
                unit_scale=False)
