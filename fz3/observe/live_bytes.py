"""Live tensor bytes, tracked through a dispatch mode: what the memory plan is checked against
where no allocator statistics exist (the CPU).

Every storage created by an op inside the context is counted from the op that created it
until the last tensor viewing it (that the mode saw) is gone. Temporaries inside one
kernel are not seen, nor tensors created before the context; the count is of storages, so
views cost nothing. A storage resized in place (the executor releases a gathered buffer a
graph still views, and regrows it later) is counted at its size as of the last ``mark``.
"""

from __future__ import annotations

import weakref
from typing import Any

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as live: ...``; then ``live.peak`` (bytes), ``live.now``; ``mark()``
    returns the peak since the previous mark (for per-op peaks)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = self._since_mark = 0
        self._refs: dict[int, int] = {}  # storage address -> tensors alive that the mode saw on it
        self._size: dict[int, int] = {}  # storage address -> bytes, as last counted
        # storage address -> a tensor on it, to read its size
        self._probe: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_address(t) for t in optree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t, new=_address(t) not in inputs)
        return out

    def _track(self, t: torch.Tensor, new: bool) -> None:
        """Count ``t``'s storage if an op allocated it here (not a view of an input: a view of
        a storage from before the context is not counted), and keep it counted while ``t``
        lives."""
        key = _address(t)
        if key == 0 or (not new and key not in self._refs):
            return
        storage = t.untyped_storage()
        if key not in self._refs:
            self._refs[key], self._size[key] = 0, storage.nbytes()
            self.now += storage.nbytes()
            self._note()
        self._refs[key] += 1
        self._probe[key] = weakref.ref(t)
        weakref.finalize(t, self._release, key)

    def _note(self) -> None:
        self.peak = max(self.peak, self.now)
        self._since_mark = max(self._since_mark, self.now)

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key], self._probe[key]
            self.now -= self._size.pop(key)

    def mark(self) -> int:
        """The peak of live bytes since the last mark (or the start), the storages' current
        sizes counted at the mark; restarts the window."""
        for key, ref in self._probe.items():
            t = ref()
            if t is not None:
                size = t.untyped_storage().nbytes()
                self.now += size - self._size[key]
                self._size[key] = size
        self._note()
        peak, self._since_mark = self._since_mark, self.now
        return peak

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.device.type != "meta" else 0
