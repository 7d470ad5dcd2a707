"""Files and folder entries on disk before a function returns: what each step of a save's
commit relies on (``commit.py``, ``owned.py``)."""

from __future__ import annotations

import errno
import logging
import os

log = logging.getLogger(__name__)


def write_durably(file: str, text: str) -> None:
    """``file`` holds ``text`` on disk (written, flushed and fsynced) before this returns."""
    with open(file, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(folder: str) -> None:
    """The folder's entries (files created, renamed into it) are on disk. A file system that
    cannot fsync a directory (some network and FUSE mounts: EINVAL, ENOTSUP) makes its
    renames durable its own way, or not at all: fz3 goes on (it cannot do better there)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
            raise
        log.warning("fz3: the file system of %s cannot fsync a folder (%s): a power loss may "
                    "undo the checkpoint's last rename there", folder, os.strerror(e.errno))
    finally:
        os.close(fd)
