"""Every Python example in README.md and docs/*.md runs, as written, so none can rot (issue 54).

A fenced block whose info string is ``python run`` is a whole program: it runs on every rank of
one gloo group of 2 (the docs say "every rank runs this"), in a fresh namespace, in a folder of
its own that both ranks share (files it writes stay there). ``python run continues`` is a
fragment: it runs in the namespace and folder of the ``run`` block before it in the same file.
A block that cannot run here (a GPU, a cluster, a path on someone's disk) says so with
``python norun: <why>``; a plain ``python`` block is refused, so every example is one or the
other by decision. Examples build tiny models from configs (no network).

The ranks are started once for all blocks (``dist.Pool``); a failing block names its file and
line, and the blocks continuing it fail after it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pathlib
import re
import textwrap

import pytest

import dist

ROOT = pathlib.Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\S*)(.*)$")


def blocks(path: pathlib.Path) -> list[tuple[int, str, str]]:
    """``(line, marker, code)`` of each fenced Python block of ``path``, in order; ``marker``
    is what follows ``python`` in the info string."""
    found, inside, start, code = [], None, 0, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = FENCE.match(line.strip()) if line.strip().startswith("```") else None
        if inside is None and m and m.group(1):
            inside, start, code = (m.group(1), m.group(2).strip()), n, []
        elif inside is not None and line.strip() == "```":
            if inside[0] == "python":  # a block inside a list item is indented with it
                found.append((start, inside[1], textwrap.dedent("\n".join(code))))
            inside = None
        elif inside is not None:
            code.append(line)
    return found


def documents() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


CASES = [(p.relative_to(ROOT).as_posix(), line, marker, code)
         for p in documents() for line, marker, code in blocks(p)]


# a rank's namespaces, by document: what a "continues" block runs in
_SCOPES: dict[str, dict] = {}


def block_ranks(rank, world, doc, line, continues, code, folder):
    scope = _SCOPES.get(doc) if continues else None
    if continues and scope is None:
        raise AssertionError(f"{doc}:{line} continues a block that did not run")
    if scope is None:
        scope = _SCOPES[doc] = {"__name__": "__docs__"}
    root, fz3_logger = logging.getLogger(), logging.getLogger("fz3")
    handlers, level = list(root.handlers), fz3_logger.level
    here = os.getcwd()
    os.chdir(folder)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, f"{doc}:{line}", "exec"), scope)
    except BaseException:
        _SCOPES.pop(doc, None)
        raise
    finally:
        os.chdir(here)
        root.handlers[:] = handlers  # a block's basicConfig stays in the block
        fz3_logger.setLevel(level)
    return "ok"


@pytest.fixture(scope="module")
def pool():
    p = dist.Pool(2)
    yield p
    p.close()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {}, tmp_path_factory


def test_every_python_block_is_marked():
    """A plain ``python`` block would never run: each says ``run`` or ``norun: why``."""
    bad = [f"{doc}:{line}" for doc, line, marker, _ in CASES
           if not (marker in ("run", "run continues") or marker.startswith("norun:"))]
    assert not bad, f"mark these python blocks 'run', 'run continues' or 'norun: <why>': {bad}"
    assert sum(marker.startswith("run") for *_, marker, _ in CASES) >= 8, CASES


@pytest.mark.parametrize("doc,line,marker,code",
                         [c for c in CASES if c[2].startswith("run")],
                         ids=[f"{c[0]}:{c[1]}" for c in CASES if c[2].startswith("run")])
def test_the_example_runs(doc, line, marker, code, pool, folders):
    made, factory = folders
    continues = marker == "run continues"
    if not continues or doc not in made:
        made[doc] = str(factory.mktemp(doc.replace("/", "_").replace(".md", "")))
    assert pool.run(block_ranks, doc, line, continues, code, made[doc], timeout=120) == ["ok"] * 2
