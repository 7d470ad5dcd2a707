"""How a save becomes the checkpoint at ``path``: each step's outcome agreed by every rank,
each file and rename made durable before the next.

[Note: committing a save]
``fz3.save(path)`` writes into ``path.partial``; the previous checkpoint at ``path`` is not
touched until the new one is complete on every rank (every rank's write returned without
error and its checksums are recorded in ``fz3.json``):

1. DCP writes each rank's data file and rank 0's ``.metadata`` (each fsynced); DCP itself
   agrees on the outcome (a failure on any rank is raised on all of them).
2. Rank 0 writes ``fz3.json`` (fsynced) and fsyncs the ``partial`` folder, then every rank
   learns rank 0's outcome (``agree``: one small all-gather).
3. Rank 0 renames ``path`` to ``path.old``, ``partial`` to ``path`` and fsyncs the parent
   folder: from here a power loss leaves the new checkpoint. Then it removes ``path.old``.
   If the second rename fails it puts ``path.old`` back. Every rank learns the outcome.

A crash between the two renames leaves ``path.old`` and no ``path``: ``load`` reads
``path.old`` then. A failure at any step raises the same ``CheckpointError`` on every rank
(no rank waits for an outcome another already knows); rank 0 removes ``path.partial``, and a
new save into ``path`` starts clean.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable

import torch.distributed as dist

from ..comm.failures import gather_objects, lost_error
from .errors import agreed_failure, cause


def attempt(fn: Callable[[], None]) -> str | None:
    """Run ``fn``: None if it returned, else its failure as one line (``cause``)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - every rank must hear of any failure, whatever it is
        return cause(e)
    return None


def agree(group: dist.ProcessGroup | None, path: str, phase: str, outcome: str | None,
          cleanup: Callable[[], None] = lambda: None) -> None:
    """Every rank's ``outcome`` of ``phase`` (None: it went well); raise the same
    ``CheckpointError`` on every rank if any failed, after ``cleanup``. **Collective** over
    ``group`` (None: every rank); a rank that is gone is named (``RankLostError``)."""
    try:
        outcomes = gather_objects(group or dist.group.WORLD, outcome)
    except RuntimeError as e:
        raise lost_error(group or dist.group.WORLD, f"fz3.save({path!r}) ({phase})", e) from e
    failure = agreed_failure(path, phase, outcomes)  # type: ignore[arg-type]
    if failure is not None:
        cleanup()
        raise failure


def write_durably(file: str, text: str) -> None:
    """``file`` holds ``text`` on disk (written, flushed and fsynced) before this returns."""
    with open(file, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(folder: str) -> None:
    """The folder's entries (files created, renamed into it) are on disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap_in(path: str, partial: str, old: str) -> None:
    """Rename ``partial`` to ``path``, the checkpoint there to ``old`` for the moment of the
    swap, durably; see [Note: committing a save]."""
    parent = os.path.dirname(os.path.abspath(path))
    had = os.path.exists(path)
    if had:
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    try:
        os.rename(partial, path)
    except OSError:
        if had:
            os.rename(old, path)
        raise
    fsync_dir(parent)
    shutil.rmtree(old, ignore_errors=True)  # also one left by a crash between the renames
