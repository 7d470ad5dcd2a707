"""What fz3 owns at a checkpoint path: the checkpoint folder (recognised by its ``fz3.json``),
the backup it makes of it during a save's swap (marked), and the claim a save holds on the
path while it writes (``path.partial``). Everything else there is the user's: never replaced,
never deleted; a save that would need it refuses, naming it.

[Note: what a save may touch]
- ``path``: nothing, an empty folder, or an fz3 checkpoint: a folder holding ``fz3.json`` and
  only names fz3 writes there (``fz3.json``, ``.metadata``, ``__<rank>_<n>.distcp``, its claim
  and backup marks). Anything else (a file, a folder of other things, a checkpoint with the
  user's files added) is refused before anything is written.
- ``path.old``: fz3's backup of the previous checkpoint during the swap, marked by the file
  ``fz3.backup`` (written, fsynced, *before* the rename) that names the checkpoint it backs
  up (``of``, the absolute path) and the save that made it (``by``). ``load`` falls back to
  ``path.old`` only when ``path`` is gone and the mark names ``path``; ``save`` removes only
  such a backup. An unmarked ``path.old`` (the user's ``mv ckpt ckpt.old``, or one left by an
  fz3 before the mark) is refused by ``save`` and ignored by ``load``.
- ``path.partial``: the claim. A save creates it with ``mkdir`` (atomic: one job wins) and
  the claim file ``fz3.claim.0`` inside, naming the save, host, process id and process start
  time. A second job finding it refuses at once, naming the other save, unless the claim is
  stale: the claiming process is gone. Stale is told only on the same host (same host name
  and boot id): the process id no longer exists, is a zombie, or is another process (its start
  time in ``/proc/<pid>/stat`` differs), or the host rebooted since (another boot id). A claim
  from another host is never called stale (fz3 cannot see that host's processes): the error
  names the host and process, and the user removes ``path.partial`` once that job is gone.
  Taking over is atomic too: the taker creates ``fz3.claim.<k+1>`` with ``O_EXCL`` over the
  stale ``fz3.claim.<k>``, so of two jobs taking over the same stale claim one wins; the
  winner removes the rest of the stale save's files. ``path.partial`` without a claim file (the
  user's, left by an fz3 before claims, or a claim being made this instant) is never deleted:
  refused, named.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import time
import uuid
from typing import NamedTuple

from .durable import fsync_dir, write_durably
from .errors import cause

META = "fz3.json"
BACKUP_MARK = "fz3.backup"
CLAIM = "fz3.claim."
_DATA = re.compile(r"__\d+_\d+\.distcp")
_OWN = {META, ".metadata", BACKUP_MARK}


def resolve(path: str | os.PathLike) -> str:
    """The absolute folder ``path`` names, symlinks followed (a link to a checkpoint is the
    checkpoint; a relative path is read against this process's working directory)."""
    return os.path.realpath(os.path.normpath(os.fspath(path)))


def new_save_id() -> str:
    return uuid.uuid4().hex[:16]


def is_own(name: str) -> bool:
    """Whether ``name`` is a file fz3 writes inside a checkpoint folder."""
    return name in _OWN or name.startswith(CLAIM) or _DATA.fullmatch(name) is not None


def refusal(folder: str) -> str | None:
    """Why ``fz3.save`` may not write a checkpoint at ``folder`` (see [Note: what a save may
    touch]), or None."""
    old = folder + ".old"
    if os.path.lexists(folder) and not os.path.isdir(folder):
        return (f"{folder} is a file, not an fz3 checkpoint: fz3.save replaces only a checkpoint "
                f"it wrote; choose another path, or move the file")
    if os.path.isdir(folder):
        names = sorted(os.listdir(folder))
        if names and META not in names:
            return (f"{folder} holds {_shown(names)} and no {META}: not an fz3 checkpoint, and "
                    f"fz3.save replaces nothing else; choose another path (a new or empty "
                    f"folder), or move what is there")
        foreign = [n for n in names if not is_own(n)]
        if foreign:
            return (f"{folder} is an fz3 checkpoint holding files fz3 did not write: "
                    f"{_shown(foreign)}; fz3.save would replace them with the folder: move them "
                    f"out first")
    if os.path.lexists(old) and backup_of(old, folder) is None:
        return (f"{old} exists and is not fz3's backup of {folder} (no {BACKUP_MARK} mark naming "
                f"it: yours, or left by an fz3 before the mark); fz3.save needs that name during "
                f"its swap and never deletes what is not its own: move or remove it (if it is a "
                f"checkpoint, fz3.load({old!r}) reads it)")
    return None


def _shown(names: list[str]) -> str:
    return str(names[:8])[:-1] + (", ...]" if len(names) > 8 else "]")


def mark_backup(folder: str, save_id: str) -> None:
    """Mark the checkpoint at ``folder`` as the backup ``save_id`` is about to make of it,
    durably, before it is renamed to ``folder.old``."""
    write_durably(os.path.join(folder, BACKUP_MARK), json.dumps({"of": folder, "by": save_id}))
    fsync_dir(folder)


def backup_of(old: str, folder: str) -> str | None:
    """The save that made ``old`` as its backup of ``folder``, or None if ``old`` is not one."""
    try:
        with open(os.path.join(old, BACKUP_MARK)) as f:
            mark = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(mark, dict) or mark.get("of") != folder:
        return None
    return str(mark.get("by"))


class Claim(NamedTuple):
    """A save's claim on ``partial``: its claim file and the save's id."""

    partial: str
    file: str
    save: str


def claim(partial: str, save_id: str) -> Claim:
    """Claim ``partial`` for save ``save_id`` (see [Note: what a save may touch]); raises
    ``FileExistsError`` naming another save holding it, or what else is there."""
    parent = os.path.dirname(partial)
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), parent)
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(partial)
        return Claim(partial, _claim_file(partial, 0, save_id), save_id)
    except FileExistsError:
        pass
    if not os.path.isdir(partial):
        raise FileExistsError(f"{partial} is a file, not fz3's: fz3.save needs that name for the "
                              f"save in progress and never deletes what is not its own: move or "
                              f"remove it")
    claims = sorted((int(n[len(CLAIM):]), n) for n in os.listdir(partial)
                    if n.startswith(CLAIM) and n[len(CLAIM):].isdigit())
    if not claims:
        raise FileExistsError(
            f"{partial} exists without fz3's claim mark ({CLAIM}<n>): yours, a save interrupted "
            f"under an fz3 before claims, or a save claiming it this instant. fz3.save never "
            f"deletes what it cannot tell is its own: if no save is running into this path, "
            f"remove it")
    k, name = claims[-1]
    holder = _read_claim(os.path.join(partial, name))
    if not _stale(holder):
        raise FileExistsError(f"another save is writing into this path: {partial} is claimed by "
                              f"{_describe(holder)}; one save at a time per path (wait for it, or "
                              f"save elsewhere)")
    try:
        mine = _claim_file(partial, k + 1, save_id)
    except FileExistsError:
        raise FileExistsError(f"another save took over the stale claim on {partial} (of "
                              f"{_describe(holder)}) a moment ago; one save at a time per path")
    for left in os.listdir(partial):  # the stale save's files, now ours to remove
        if os.path.join(partial, left) != mine:
            target = os.path.join(partial, left)
            shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
    return Claim(partial, mine, save_id)


def take_path(folder: str, save_id: str) -> tuple[Claim | None, str | None, str | None]:
    """Rank 0's start of a save: ``(its claim, None, None)``, or why it may not write there
    (``refusal``, another save's claim), or the failure claiming it (an ``OSError``'s cause)."""
    try:
        refused = refusal(folder)
        if refused is not None:
            return None, refused, None
        return claim(folder + ".partial", save_id), None, None
    except FileExistsError as e:
        return None, str(e), None
    except OSError as e:
        return None, None, cause(e)


def release(c: Claim) -> None:
    """Remove ``c.partial`` if this save still holds it (a failed save's leftovers)."""
    if os.path.isfile(c.file):
        shutil.rmtree(c.partial, ignore_errors=True)


def _claim_file(partial: str, k: int, save_id: str) -> str:
    file = os.path.join(partial, f"{CLAIM}{k}")
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump({"save": save_id, **_process(os.getpid()), "since": time.time()}, f)
    return file


def _process(pid: int) -> dict:
    return {"host": socket.gethostname(), "boot": _boot_id(), "pid": pid,
            "start": _start_time(pid)}


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def _start_time(pid: int) -> str:
    fields = _stat(pid)
    return fields[19] if fields and len(fields) > 19 else ""  # field 22: starttime


def _read_claim(file: str) -> dict:
    try:
        with open(file) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}  # being written this instant, or damaged: not stale (never taken on a guess)


def _stale(holder: dict) -> bool:
    here = _process(os.getpid())
    if not holder or holder.get("host") != here["host"]:
        return False  # another host's process: fz3 cannot see it
    if holder.get("boot") and here["boot"] and holder["boot"] != here["boot"]:
        return True  # rebooted since
    pid = int(holder.get("pid", 0))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    fields = _stat(pid)
    if fields is not None and fields[0] in ("Z", "X"):
        return True  # exited, not yet reaped
    return bool(holder.get("start")) and _start_time(pid) not in ("", holder["start"])


def _describe(holder: dict) -> str:
    if not holder:
        return "a save whose claim file cannot be read yet"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return (f"save {holder.get('save')} of process {holder.get('pid')} on host "
            f"{holder.get('host')}, since {since}")
