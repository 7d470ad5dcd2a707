"""Live tensor bytes, tracked through a dispatch mode: what the memory plan is checked against
where no allocator statistics exist (the CPU).

Every storage created by an op inside the context is counted from the op that created it
until the storage itself is gone (whoever held it: a tensor, a view, a graph, a backend's
pending work). Temporaries inside one kernel are not seen, nor storages created before the
context; views cost nothing. Sizes are read at every op, so a storage resized in place (the
executor releases a gathered buffer a graph still views, and regrows it later) counts at
its size of the moment.

Storages are told apart by identity, never by address: a released buffer's address can be
handed to a new allocation while the old storage object lives on at size zero.

``writes=True`` also counts a storage made before the context from the first op that writes
into it (an argument the op's schema marks written, a ``copy_``'s destination; an output of
an op that is neither a view op nor made of other ops aliasing an input, a collective's
output): a step function keeps its gathered buffers' objects between steps, their storage
released (``fz3.step.memory``), and regrows them outside any op; the parameters,
only read by a step, are not counted.
"""

from __future__ import annotations

import weakref

import optree
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode


SET = torch.ops.aten.set_


def _real(t: object) -> bool:
    """A tensor with memory of its own: not on the meta device, not a fake tensor
    (``fz3.shard(example=)`` and traces run ops on those: shapes only)."""
    return isinstance(t, torch.Tensor) and t.device.type != "meta" and \
        not isinstance(t, FakeTensor)


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as live: ...``; then ``live.peak`` (bytes), ``live.now``; ``mark()``
    returns the peak since the previous mark (for per-op peaks).

    Each op costs a pass over the storages alive: a measuring tool, not for a hot path."""

    def __init__(self, *, writes: bool = False) -> None:
        super().__init__()
        self.writes = writes
        self.now = self.peak = self._since_mark = 0
        # id of a storage object -> a weak reference to it; the entry leaves when it dies
        self._live: dict[int, weakref.ref] = {}
        self._made_of_ops: dict = {}  # op -> whether it is CompositeImplicitAutograd

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is SET:  # points a tensor at a storage made elsewhere (one that
            return out  # owns nothing of its own)
        inputs = {id(t.untyped_storage()) for t in optree.tree_leaves((args, kwargs))
                  if _real(t)}
        # (an output aliasing an input: written; not by a view op, nor by a composite op seen
        # whole, as below autograd (``fz3.step.programs``): ``unflatten_dense_tensors``' views)
        written = self.writes and not func.is_view and not self._composite(func)
        for t in optree.tree_leaves(out):
            if _real(t):
                storage = t.untyped_storage()
                key = id(storage)
                if (written or key not in inputs) and key not in self._live:
                    self._track(storage)
        if self.writes and func._schema.is_mutable:  # written, maybe not returned
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = args[i] if i < len(args) else (kwargs or {}).get(arg.name)
                    for t in optree.tree_leaves(value):
                        if _real(t) and \
                                id(t.untyped_storage()) not in self._live:
                            self._track(t.untyped_storage())
        self._count()
        return out

    def _composite(self, func) -> bool:
        """An op made of other ops, which writes into nothing its schema does not mark
        written."""
        known = self._made_of_ops.get(func)
        if known is None:
            known = self._made_of_ops[func] = torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), "CompositeImplicitAutograd")
        return known

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        self._live[key] = weakref.ref(storage, lambda _, k=key: self._live.pop(k, None))

    def _count(self) -> None:
        sizes = (ref() for ref in list(self._live.values()))
        self.now = sum(s.nbytes() for s in sizes if s is not None)
        self.peak = max(self.peak, self.now)
        self._since_mark = max(self._since_mark, self.now)

    def mark(self) -> int:
        """The peak of live bytes since the last mark (or the start), the storages' sizes of
        this moment counted too; restarts the window."""
        self._count()
        peak, self._since_mark = self._since_mark, self.now
        return peak
