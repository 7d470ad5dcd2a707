"""Which part of the model each parameter belongs to: the unit list ``fz3.shard`` builds.

A module becomes, in compute order:

- ``pre``: parameters registered before the first stack (``pre(m, batch)`` uses them);
- one *stack* per run of structurally identical consecutive layers of each container
  (``nn.ModuleList``, ``nn.Sequential``, ``nn.ModuleDict``) named by ``layers=``
  (``[A, A, B, B, B]`` is two stacks), stored ``(k, shard)``;
- ``between.i``: parameters registered between stack path i and path i+1 (``between[i]``);
- ``post``: parameters registered after the last stack (``post(m, h, batch)``);
- one *shared* part per parameter tied across those (a token embedding that is also the LM
  head): gathered for the compute ops that read it, its gradient contributions summed
  before one reduce.

"Registered before/after" is the order of ``module.named_parameters()``: submodules in the
order ``__init__`` assigned them, each module's own parameters before its submodules' (so a
parameter held directly by a module that holds a stack counts as before that stack).
``assign=`` overrides it by name prefix.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

from torch import nn

from ..schedule.structure import PartShape, Role
from .checks import check_path_order, layer_children
from .placement import Move, assigned, homes_by_use
from .layout import FlatLayout

# (every name, parameter), first appearance order
Named = list[tuple[tuple[str, ...], nn.Parameter]]


class Part(NamedTuple):
    """One part of a sharded model: flat layouts per row (trained and frozen parameters apart),
    and how its rows are named."""

    # "pre", "blocks", "blocks[0:2]" (a run of a container), "between.0", "post", "tied:..."
    name: str
    role: Role
    # one row's trained parameters: slot names full, or relative to the layer for stacks
    layout: FlatLayout
    rows: int  # layers of a stack; 1 otherwise
    path: str = ""  # stacks: the container's path
    first: int = 0  # stacks: index of the first layer of this run in the container
    reads: tuple[int, ...] = ()  # shared parts this part's compute reads
    frozen: FlatLayout | None = None  # one row's frozen parameters (requires_grad=False), if any
    keys: tuple[str, ...] = ()  # stacks: each row's name in the container ("3"; a ModuleDict's key)

    def prefix(self, row: int = 0) -> str:
        """What the row's slot names are relative to: ``"blocks.3."`` for layer 3, else ``""``."""
        return f"{self.path}.{self.keys[row]}." if self.role is Role.STACK else ""

    @property
    def shape(self) -> PartShape:
        return PartShape(self.name, self.role, self.rows, self.reads, self.path, self.first)


class Parts(tuple):
    """A model's parts, in compute order (a tuple of ``Part``). ``print(model.parts)`` shows a
    table, one line per part: its name and role, rows, parameters per row, the bytes stored
    (trained ones in fp32, frozen ones in their dtype), and which shared parts it reads or,
    for a shared part, who reads it; then each parameter placed by use in another part than
    its registration gives, and why; ``repr`` is the tuple's (for debugging)."""

    frozen_size: int = 4  # bytes per frozen element (``Precision.frozen``)
    moves: tuple["Move", ...] = ()  # parameters placed by use in another part than registration's

    def __new__(cls, parts: Sequence[Part], frozen_size: int = 4,
                moves: Sequence["Move"] = ()) -> "Parts":
        out = super().__new__(cls, parts)
        out.frozen_size = frozen_size
        out.moves = tuple(moves)
        return out

    def __str__(self) -> str:
        head = ("part", "role", "rows", "params/row", "trained", "frozen", "shared")
        rows = [head]
        for i, p in enumerate(self):
            frozen = 0 if p.frozen is None else p.frozen.numel
            if p.role is Role.SHARED:
                readers = [q.name for q in self if i in q.reads]
                shared = "read by " + ", ".join(readers)
            else:
                shared = "reads " + ", ".join(self[r].name for r in p.reads) if p.reads else ""
            rows.append((p.name, p.role.value, str(p.rows), f"{p.layout.numel + frozen:,}",
                         _bytes(p.rows * p.layout.numel * 4),
                         _bytes(p.rows * frozen * self.frozen_size) if frozen else "-", shared))
        widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
        table = "\n".join("  ".join(cell.ljust(w) if c in (0, 1, 6) else cell.rjust(w)
                                    for c, (cell, w) in enumerate(zip(r, widths))).rstrip()
                          for r in rows)
        moved = [f"  {m.name}: registered in {m.registered}, read by {m.read_by}"
                 for m in self.moves]
        return "\n".join([table, *(["placed by use (example=):", *moved] if moved else [])])

    def __repr__(self) -> str:
        return tuple.__repr__(self)


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class Partition(NamedTuple):
    parts: tuple[Part, ...]
    params: tuple[list[Named], ...]  # per part, per row: the parameters (trained and frozen)
    moves: tuple[Move, ...] = ()


def partition(module: nn.Module, paths: Sequence[str], world: int, *, between: Sequence[bool],
              assign: Mapping[str, str] | None = None,
              used: Mapping[str, set[str]] | None = None) -> Partition:
    """Split ``module``'s parameters into parts (see the module docstring). ``between``: per
    gap between two paths, whether a between function runs there (a part exists only then).
    ``used`` (``fz3.shard(example=...)``, ``fz3/sharding/placement.py``): parameter name ->
    the functions that read it; a parameter outside the stacks goes to the part of the
    function that reads it (a shared part when several do), ``assign=`` first, registration
    order for one that none reads."""
    stacks = [(path, layer_children(module, path)) for path in paths]
    check_path_order(module, paths)
    assign = assign or {}
    # a parameter of a layer named by ``assign`` leaves its layer: the layers are compared
    # and stacked without it (T5's block 0 owns the position bias every block reads)
    kept = {path: [_named_params(b, f"{path}.{key}.", assign) for key, b in stack]
            for path, stack in stacks}
    keys = {path: [key for key, _ in stack] for path, stack in stacks}
    runs = [(path, first, kept[path][first:first + k])
            for path, _ in stacks for first, k in _runs(kept[path])]
    in_stack = _stack_parameters(paths, runs, module, keys)
    single, shared, moves = _outside_stacks(module, paths, in_stack, between, assign, used)
    parts: list[Part] = []
    params: list[list[Named]] = []

    def add(part: Part, rows: list[Named]) -> None:
        trained = [(n, p) for n, p in rows[0] if p.requires_grad] if rows else []
        frozen = [(n, p) for n, p in rows[0] if not p.requires_grad] if rows else []
        part = part._replace(layout=FlatLayout.build(trained, world),
                             frozen=FlatLayout.build(frozen, world) if frozen else None)
        parts.append(part)
        params.append(rows)

    add(Part("pre", Role.PRE, None, 1), [single["pre"]])
    for i, (path, _) in enumerate(stacks):
        mine = [r for r in runs if r[0] == path]
        for _, first, rows in mine:
            name = path if len(mine) == 1 else f"{path}[{first}:{first + len(rows)}]"
            add(Part(name, Role.STACK, None, len(rows), path, first,
                     keys=tuple(keys[path][first:first + len(rows)])), rows)
        if i < len(between) and between[i]:
            key = f"between.{i}"
            add(Part(key, Role.BETWEEN, None, 1), [single[key]])
    add(Part("post", Role.POST, None, 1), [single["post"]])
    readers = {p.name: i for i, p in enumerate(parts)}
    reads: dict[int, list[int]] = {}
    for name, named, homes in shared:
        for home in homes:
            reads.setdefault(readers[home], []).append(len(parts))
        add(Part(name, Role.SHARED, None, 1), [named])
    parts = [p._replace(reads=tuple(reads.get(i, ()))) for i, p in enumerate(parts)]
    return Partition(tuple(parts), tuple(params), tuple(moves))


def _outside_stacks(module: nn.Module, paths: Sequence[str], in_stack: set[int],
                    between: Sequence[bool], assign: Mapping[str, str],
                    used: Mapping[str, set[str]] | None):
    """``(single, shared, moves)``: the parameters outside the stacks by home part ("pre",
    "between.i", "post"), those with several homes (tied, or read by several functions), and
    those placed by use elsewhere than registration puts them."""
    segments = _segments(module, paths, assign, between)
    by_id: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in in_stack:
            by_id.setdefault(id(p), ([], p))[0].append(name)
    single: dict[str, Named] = {"pre": [],
                                **{f"between.{i}": [] for i, on in enumerate(between) if on},
                                "post": []}
    shared: list[tuple[str, Named, set[str]]] = []
    moves: list[Move] = []
    for names, p in by_id.values():
        homes = {segments[n] for n in names}
        readers = homes_by_use(names, used, assign)
        if readers and readers != homes:
            moves.append(Move(names[0], "+".join(sorted(h or "?" for h in homes)),
                              "+".join(sorted(readers))))
            homes = readers
        if None in homes:
            raise ValueError(_unplaced(next(n for n in names if segments[n] is None), module,
                                       paths))
        if len(homes) == 1:
            single[homes.pop()].append((tuple(names), p))
        else:
            shared.append((f"tied:{names[0]}", [(tuple(names), p)], homes))
    return single, shared, moves


def _named_params(module: nn.Module, prefix: str = "",
                  assign: Mapping[str, str] | None = None) -> Named:
    """``(all names, param)`` in first-appearance order; tied parameters appear once. With
    ``assign``, those whose full name (``prefix + name``) it names are left out."""
    by_id: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if assign and assigned(prefix + name, assign) is not None:
            continue
        by_id.setdefault(id(p), ([], p))[0].append(name)
    return [(tuple(names), p) for names, p in by_id.values()]


def _runs(layers: Sequence[Named]) -> list[tuple[int, int]]:
    """``(first, count)`` of each run of structurally identical consecutive layers (each given
    by its named parameters)."""
    sigs = [[(names, tuple(p.shape), p.dtype, p.requires_grad) for names, p in layer]
            for layer in layers]
    runs: list[tuple[int, int]] = []
    for i, sig in enumerate(sigs):
        if runs and sigs[runs[-1][0]] == sig:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _stack_parameters(paths: Sequence[str], runs, module: nn.Module,
                      keys: Mapping[str, Sequence[str]]) -> set[int]:
    """Ids of every parameter inside a stack; refuses parameters shared between layers or
    used both inside a stack and outside it."""
    seen: dict[int, str] = {}
    for path, first, rows in runs:
        for j, layer in enumerate(rows):
            for names, p in layer:
                where = f"{path}.{keys[path][first + j]}.{names[0]}"
                if id(p) in seen:
                    raise ValueError(f"{where} is the same Parameter as {seen[id(p)]}; layers of "
                                     f"a stack must not share parameters")
                seen[id(p)] = where
    for names, p in _named_params(module):
        if id(p) in seen and any(not any(n.startswith(path + ".") for path in paths)
                                 for n in names):
            inside = next(path for path in paths
                          if any(n.startswith(path + ".") for n in names))
            raise ValueError(f"parameter {names} is used both inside {inside!r} and outside it; "
                             f"fz3 shards the layers and the parts around them separately: "
                             f"untie it or move it")
    return set(seen)


def _segments(module: nn.Module, paths: Sequence[str], assign: Mapping[str, str],
              between: Sequence[bool]) -> dict[str, str | None]:
    """Each parameter name outside the stacks -> "pre", "between.i" or "post", by where it is
    registered relative to the stacks (or by ``assign``, longest matching prefix first); None
    in a gap where no between function runs."""
    n = len(paths)
    valid = {"pre", "post", *(f"between.{i}" for i, on in enumerate(between) if on)}
    bad = {k: v for k, v in assign.items() if v not in valid}
    if bad:
        raise ValueError(f"assign={bad}: parts are {sorted(valid)}")
    out: dict[str, str | None] = {}
    started = 0  # stacks whose parameters have begun
    for name, _ in module.named_parameters(remove_duplicate=False):
        inside = [i for i, path in enumerate(paths) if name.startswith(path + ".")]
        match = assigned(name, assign)
        if inside:
            started = max(started, inside[0] + 1)
            if match is None:
                continue
        if match is not None:
            out[name] = assign[match]
        elif started in (0, n):
            out[name] = "pre" if started == 0 else "post"
        elif between[started - 1]:
            out[name] = f"between.{started - 1}"
        else:  # no function runs there: refused unless placed by use (``_unplaced``)
            out[name] = None
    return out


def _unplaced(name: str, module: nn.Module, paths: Sequence[str]) -> str:
    """Why ``name``, registered in a gap between stacks where no function runs, has no part."""
    started = 0
    for other, _ in module.named_parameters(remove_duplicate=False):
        inside = [i for i, path in enumerate(paths) if other.startswith(path + ".")]
        started = max([started, *(i + 1 for i in inside[:1])])
        if other == name:
            break
    return (f"parameter {name} is registered between {paths[started - 1]!r} and "
            f"{paths[started]!r}, where no between function runs: pass between=[...] with a "
            f"function for that gap, assign={{{name!r}: 'pre' | 'post'}}, or example=<a batch> "
            f"to place it by what reads it")
