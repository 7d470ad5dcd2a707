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
3. Rank 0 marks the checkpoint at ``path`` as this save's backup (``owned.py``), renames it
   to ``path.old``, ``partial`` to ``path`` and fsyncs the parent folder: from here a power
   loss leaves the new checkpoint. Then it removes ``path.old``. If the second rename fails
   it puts ``path.old`` back. Every rank learns the outcome.

Before step 1 rank 0 checks that ``path`` holds nothing of the user's and claims
``path.partial`` (``owned.py``'s [Note: what a save may touch]); every rank learns the
outcome with its resolved folder (``checkpoint.py``). A crash between the two renames leaves
the marked ``path.old`` and no ``path``: ``load`` reads ``path.old`` then. A failure at any
step raises the same ``CheckpointError`` on every rank (no rank waits for an outcome another
already knows); rank 0 removes ``path.partial`` (its claim), and a new save into ``path``
starts clean.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable

import torch.distributed as dist

from ..comm.failures import gather_objects, lost_error
from .durable import fsync_dir
from .errors import agreed_failure, cause
from .owned import BACKUP_MARK, backup_of, mark_backup, refusal


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


def swap_in(folder: str, partial: str, save_id: str) -> None:
    """Rename ``partial`` to ``folder``, the checkpoint there to ``folder.old`` (marked as this
    save's backup) for the moment of the swap, durably; see [Note: committing a save]. Removes
    only a backup fz3 marked ([Note: what a save may touch])."""
    old = folder + ".old"
    parent = os.path.dirname(folder)
    had = os.path.isdir(folder)
    if had:
        if os.path.lexists(old):  # a backup left by a save that crashed after its swap
            if backup_of(old, folder) is None:
                raise FileExistsError(refusal(folder))
            shutil.rmtree(old)
        mark_backup(folder, save_id)
        os.rename(folder, old)
    try:
        os.rename(partial, folder)
    except OSError:
        if had:
            os.rename(old, folder)
            os.remove(os.path.join(folder, BACKUP_MARK))
        raise
    fsync_dir(parent)
    if backup_of(old, folder) is not None:  # also one left by a crash between the renames
        shutil.rmtree(old)
