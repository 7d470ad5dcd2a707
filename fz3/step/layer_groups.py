"""Which layers of a stack may share traced programs (``fz3.step.traced``).

Layers whose modules hold the same Python state (every attribute that is not a parameter, a
submodule or an empty hook table) run the same code with the same constants: ``Groups.own``
numbers them. Layers that differ only in plain values (HF's ``layer_idx``: ``Groups.varying``)
share programs too if the trace of one of them never reads those values: ``Groups.alike``
numbers such layers, and ``hidden`` is how that is found out, in one trace (see
[Note: hidden attributes]).

[Note: hidden attributes]
While the first layer of an ``alike`` group is traced, each varying attribute of its modules
holds an ``Unread`` instead of its value, restored afterwards (the skeleton is fz3's own, as
are the parameters a ``Binding`` puts into it per call). Every use of an ``Unread`` (truth,
comparison, arithmetic, indexing, hashing, formatting, attribute access) raises, so a trace
that completes computed nothing from those values: every layer of the group would trace to
the same graph, and shares its programs. A trace that fails so is made again per ``own``
group, as before (HF's ``layer_idx`` is read only by a KV cache, which training does not
pass). Only ints, floats and strings of one type in every layer are hidden (``is None`` and
``is True`` would pass an ``Unread`` by), and the hidden trace must read exactly like the
same layer's trace with its own values (``fz3.step.traced``: one trace more per stack):
``type()`` of the value, the one use that neither raises nor shows in the graph, is then
the same for every layer too.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, NamedTuple, Sequence

import torch

from ..sharding.binding import Binding
from ..sharding.parts import Part
from .codegen import TraceError


class Groups(NamedTuple):
    own: list[int]  # layer -> group: the same Python state
    alike: list[int]  # layer -> group: the same Python state but for ``varying``
    # (module path, attribute) of plain values that differ between the stack's layers
    varying: tuple[tuple[str, str], ...]


def groups(bindings: Sequence[Binding], part: Part, failed: dict[str, str]) -> Groups:
    """The stack's ``Groups``. Records in ``failed`` a part whose layers hold state a trace
    cannot see (hooks, shared reads; buffers are the programs' inputs)."""
    states = []
    for layer, binding in enumerate(bindings):
        try:
            states.append(_state(binding))
        except TraceError as e:
            failed[part.name] = f"layer {part.path}.{part.first + layer} cannot be traced: {e}"
            return Groups([], [], ())
    if part.reads:
        failed[part.name] = f"{part.name} reads shared parameters"
    varying = _varying([attrs for _, _, attrs in states])
    own: dict[tuple, int] = {}
    alike: dict[tuple, int] = {}
    out_own, out_alike = [], []
    for fn, modules, attrs in states:
        items = sorted(attrs.items(), key=lambda kv: kv[0])
        out_own.append(own.setdefault((fn, modules, tuple(items)), len(own)))
        rest = tuple(kv for kv in items if kv[0] not in varying)
        out_alike.append(alike.setdefault((fn, modules, rest, tuple(k for k, _ in items)),
                                          len(alike)))
    return Groups(out_own, out_alike, varying)


def _varying(layers: list[dict]) -> tuple[tuple[str, str], ...]:
    """The attributes every layer holds, each a plain value of one type (not None, not a
    bool: ``is`` tests on those would pass an ``Unread`` by), whose values differ."""
    common = set(layers[0]).intersection(*layers[1:]) if layers else set()
    out = []
    for key in common:
        values = [attrs[key] for attrs in layers]
        kinds = {type(v) for v in values}
        if (len(kinds) == 1 and kinds <= {int, float, str} and len(set(values)) > 1):
            out.append(key)
    return tuple(sorted(out))


@contextlib.contextmanager
def hidden(binding: Binding, varying: Sequence[tuple[str, str]]) -> Iterator[None]:
    """The layer's ``varying`` attributes as ``Unread`` while inside; restored after."""
    saved = []
    try:
        for path, name in varying:
            module = binding.module.m.get_submodule(path)
            saved.append((module, name, module.__dict__[name]))
            module.__dict__[name] = Unread(f"{path}.{name}" if path else name)
        yield
    finally:
        for module, name, value in saved:
            module.__dict__[name] = value


class Unread:
    """An attribute's stand-in that no use of may succeed ([Note: hidden attributes]): its
    class too is refused (``isinstance`` asks for it once the type differs)."""

    __slots__ = ("_name",)

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TraceError(f"it reads {object.__getattribute__(self, '_name')}, whose value "
                         f"differs between layers")

    def __getattr__(self, name: str) -> Any:
        return self._refuse()

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return self._refuse()


for _dunder in ("bool index int float complex eq ne lt le gt ge hash str repr format len iter "
                "next contains getitem setitem add radd sub rsub mul rmul truediv "
                "rtruediv floordiv rfloordiv mod rmod pow rpow neg pos abs and rand or ror xor "
                "rxor lshift rlshift rshift rrshift invert round trunc floor ceil matmul "
                "rmatmul divmod rdivmod enter exit fspath").split():
    setattr(Unread, f"__{_dunder}__", Unread._refuse)

def _state(binding: Binding) -> tuple[int, tuple, dict]:
    """What a layer's code can read besides its parameters and inputs: its function, its
    modules' paths, types and buffers' shapes and dtypes, and their attributes (``(path,
    name) -> value``, or its id where the value is not plain)."""
    modules, attrs = [], {}
    for path, module in binding.module.m.named_modules():
        # buffers are the programs' inputs (``fz3.step.traced``): their shapes and dtypes
        # are what the programs are specialized to, their values are not
        buffers = tuple((k, tuple(b.shape), b.dtype) for k, b in module._buffers.items()
                        if b is not None)
        if any(b is not None and b.requires_grad for b in module._buffers.values()):
            raise TraceError(f"{path or 'it'} has a buffer that requires grad")
        for k, v in vars(module).items():
            if k in _MODULE_OWN:  # nn.Module's own tables: only hooks matter to a trace
                if v and "hook" in k and ("forward" in k or "backward" in k) and \
                        not isinstance(v, bool):
                    raise TraceError(f"{path or 'it'} has hooks ({k}), which a trace would skip")
                continue
            attrs[path, k] = v if _plain(v) else _Id(id(v))
        modules.append((path, type(module), buffers))
    return id(binding.module.fn), tuple(modules), attrs


class _Id(NamedTuple):
    """A value that is not plain, compared by identity (never hidden)."""

    id: int


_MODULE_OWN = frozenset(vars(torch.nn.Module()))


def _plain(v: Any) -> bool:
    if isinstance(v, (tuple, frozenset)):
        return all(_plain(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str, torch.dtype))
