"""What a failed ``fz3.save`` or a damaged checkpoint raises, and how DCP's failures become it.

DCP reports a failure on any rank as ``CheckpointException``, a ``BaseException`` (an
``except Exception:`` in a training loop misses it) whose first line lists rank numbers and
no cause. fz3 raises instead, on every rank alike:

- ``CheckpointError(RuntimeError)``: a save failed (disk full, permission, a bad path): the
  failing ranks, the path and each cause (the ``OSError``'s errno text). The previous
  checkpoint is untouched and a retry into the same path works.
- ``CheckpointDamagedError(CheckpointError, ValueError)``: a checkpoint that cannot be loaded
  as it is on disk (missing, truncated or unreadable files, a checksum that does not match);
  a ``ValueError`` too, so code written for the earlier errors keeps working.
- ``CheckpointMismatchError(CheckpointError)``: the ranks did not all find the same checkpoint
  at the path (node-local copies that differ, a save replacing it between the ranks' looks or
  during the read, different working directories), naming each rank and what it saw.
- ``fz3.RankLostError`` when a rank died in the middle, ``fz3.RankInterruptedError`` when one
  was interrupted (``fz3/comm/failures.py``).
"""

from __future__ import annotations

import errno
import os
from typing import Any

import torch.distributed as dist

from ..comm.failures import RankInterruptedError, RankLostError, is_interrupt, lost_error


class CheckpointError(RuntimeError):
    """``fz3.save`` failed on ``ranks``: every rank raises it, naming ``path`` and each cause;
    nothing of the previous checkpoint at ``path`` was changed."""

    def __init__(self, message: str, path: str = "", ranks: list[int] | None = None):
        super().__init__(message)
        self.path = path
        self.ranks = ranks or []

    def __reduce__(self):  # DCP pickles a rank's failure to the others: keep path and ranks
        return type(self), (str(self), self.path, self.ranks)


class CheckpointDamagedError(CheckpointError, ValueError):
    """The checkpoint at ``path`` cannot be loaded as it is on disk: a file missing,
    truncated or unreadable, or bytes whose checksum does not match the one recorded at save.
    Load the previous checkpoint, or save again."""


class CheckpointMismatchError(CheckpointError):
    """The ranks of a ``fz3.load`` did not all find the same checkpoint at ``path`` (or it
    changed while they read it): raised on every rank, naming each rank and what it saw.
    Nothing was loaded; load again once one checkpoint is at the path for every rank."""


def cause(e: BaseException) -> str:
    """One line for a failure: an ``OSError``'s errno text and file, else its type and message."""
    if isinstance(e, OSError) and e.errno is not None:
        where = f" ({e.filename})" if e.filename else ""
        return f"{errno.errorcode.get(e.errno, e.errno)}: {os.strerror(e.errno)}{where}"
    first = (str(e).splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {first}"


def failures_of(e: BaseException) -> dict[int, BaseException] | None:
    """DCP's ``CheckpointException`` as ``{rank: exception}``; None for any other exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(e, CheckpointException):
        return None
    return {int(r): pair[0] for r, pair in sorted(e.failures.items())}


def save_failure(group: dist.ProcessGroup | None, path: str, phase: str,
                 e: BaseException) -> BaseException:
    """What every rank raises when ``phase`` of ``fz3.save(path)`` failed with ``e``.

    DCP's own failures name each failing rank's exception (the same dict on every rank, so
    the same error everywhere); anything else is a collective that broke, where the ranks'
    heartbeats say who is gone (``RankLostError``)."""
    failed = failures_of(e)
    if failed is not None and any(is_interrupt(x) for x in failed.values()):
        return interrupt_failure(f"fz3.save({path!r}) ({phase})", failed)
    if failed is None and not _is_transport(e):
        return e if isinstance(e, Exception) else RuntimeError(str(e))  # a local error: itself
    if failed is None or all(_is_transport(x) for x in failed.values()):
        return lost_error(group or dist.group.WORLD, f"fz3.save({path!r}) ({phase})", e)
    mine = {r: x for r, x in failed.items() if not _is_transport(x)}
    return CheckpointError(_message(path, phase, mine), path, sorted(mine))


def interrupt_failure(what: str, failed: dict[int, BaseException]) -> BaseException:
    """What every rank raises when DCP's step failed because ranks were interrupted: the
    interrupted rank its own interrupt, the others ``RankInterruptedError`` naming them."""
    stopped = {r: x for r, x in failed.items() if is_interrupt(x)}
    mine = stopped.get(dist.get_rank())
    if mine is not None:
        return mine
    shown = "; ".join(f"rank {r}: {type(x).__name__}" for r, x in stopped.items())
    return RankInterruptedError(f"{what} stopped: rank(s) {sorted(stopped)} were interrupted "
                                f"({shown}); nothing else failed. A save leaves the previous "
                                f"checkpoint as it was", sorted(stopped))


def agreed_failure(path: str, phase: str, outcomes: list[str | None]) -> CheckpointError | None:
    """The error every rank raises after ``phase``, from each rank's outcome (None: it went
    well; else its ``cause``), or None when every rank's went well."""
    failed = {r: c for r, c in enumerate(outcomes) if c is not None}
    if not failed:
        return None
    shown = "; ".join(f"rank {r}: {c}" for r, c in failed.items())
    return CheckpointError(f"fz3.save({path!r}) failed {phase} on rank(s) {sorted(failed)}: "
                           f"{shown}. {_FIX}", path, sorted(failed))


_FIX = ("The previous checkpoint there (if any) is untouched; free space or fix the path or "
        "permissions, then save again (a retry into the same path works)")


def _message(path: str, phase: str, failed: dict[int, BaseException]) -> str:
    shown = "; ".join(f"rank {r}: {cause(x)}" for r, x in failed.items())
    return f"fz3.save({path!r}) failed {phase} on rank(s) {sorted(failed)}: {shown}. {_FIX}"


_PEER_GONE = ("Connection closed", "Connection reset", "Broken pipe", "Timed out", "timed out")


def _is_transport(e: Any) -> bool:
    """A collective's failure that only says a peer went away (gloo's 'Connection closed by
    peer', NCCL's abort), not why: the heartbeats tell."""
    return isinstance(e, (RankLostError, dist.DistBackendError)) or (
        isinstance(e, RuntimeError) and any(s in str(e) for s in _PEER_GONE))


def load_failure(path: str, failed: dict[int, BaseException]) -> "CheckpointDamagedError":
    """DCP's read failed on the ranks of ``failed`` (no rank lost, no interrupt, no writer's
    swap: those are told apart before): damage named by a verifying reader, or the storage."""
    damaged = [str(x) for x in failed.values() if isinstance(x, CheckpointDamagedError)]
    if damaged:
        return CheckpointDamagedError(" | ".join(damaged), path, sorted(failed))
    shown = "; ".join(f"rank {r}: {type(x).__name__}: {str(x)[:1000]}" for r, x in failed.items())
    return CheckpointDamagedError(
        f"checkpoint {path} is damaged inside a file, or the storage failed: its files have their "
        f"full length and fit the model and the template, yet reading them failed: {shown}",
        path, sorted(failed))
