"""The layout guards itself: ``fz3/`` parsed with ``ast`` (no imports run).

- No import cycles between fz3's modules, counting imports inside functions (a cycle hidden
  in a function is still a cycle) and imports from the package root (``fz3/__init__.py``
  imports everything, so a module importing from it closes a cycle).
- No module imports another module's private (``_name``) names.
- Lines are at most 100 columns.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "fz3"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _package(name: str, path: pathlib.Path) -> str:
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> list[tuple[str, str, int]]:
    """``(imported module, imported name or "", line)`` for every fz3 import in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "fz3"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package(name, path).split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "fz3":
                target = node.module
            else:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub, "", node.lineno) if sub in modules else (target, a.name, node.lineno))
    return out


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_cycles():
    modules = _modules()
    graph = {m: {t for t, _, _ in imports(m, p, modules) if t != m and t in modules} for m, p in modules.items()}
    graph["fz3"] = set()  # the package face re-exports everything; its own edges are not design edges
    importers_of_root = [f"{m} (line {line})" for m, p in modules.items() if m != "fz3"
                         for t, _, line in imports(m, p, modules) if t == "fz3"]
    assert not importers_of_root, f"modules import from the package root fz3/__init__.py: {importers_of_root}"
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in fz3:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_imports_of_private_names():
    modules = _modules()
    bad = [f"{m}:{line} imports {name} from {t}" for m, p in modules.items()
           for t, name, line in imports(m, p, modules) if name.startswith("_") and t != m]
    bad += [f"{m}:{line} imports the private module {t}" for m, p in modules.items()
            for t, _, line in imports(m, p, modules) if t.rsplit(".", 1)[-1].startswith("_")]
    assert not bad, "\n".join(bad)


def test_lines_fit_100_columns():
    wide = [f"{p.relative_to(ROOT.parent)}:{i}" for p in ROOT.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > 100]
    assert not wide, f"{len(wide)} lines over 100 columns: {wide[:20]}"


def test_the_guard_sees_cycles_and_private_imports(tmp_path):
    """The checks above on a made-up module graph: they can fail."""
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    tree = {"fz3.x": ROOT / "x.py", "fz3.y": ROOT / "y.py"}
    src = tmp_path / "x.py"
    src.write_text("from .y import _hidden\n\ndef f():\n    from . import y\n")
    found = imports("fz3.x", src, {**tree, "fz3.x": src})
    assert ("fz3.y", "_hidden", 1) in found and ("fz3.y", "", 4) in found
