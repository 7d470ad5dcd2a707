"""DCP's file writer and reader with a checksum per storage item (see ``checksums.py``).

- ``ChecksumWriter`` (a ``FileSystemWriter``): its file streams fold every write into a CRC-32
  between two ``tell()`` calls, which DCP makes before and after each item; the ranks'
  checksums travel to the coordinator inside DCP's own write results (``Summed``), and
  ``finish`` keeps them in ``writer.checksums`` and hands DCP its plain results, so the
  ``.metadata`` file stays DCP's. An item whose range does not match a measured one (a DCP
  that writes another way) is read back once to be checksummed.
- ``VerifyingReader`` (a ``FileSystemReader``): before DCP reads a plan's items, reads each
  whole and compares its CRC-32; a mismatch raises ``CheckpointDamagedError`` naming the file,
  the item and the rank. DCP then reads the same bytes, from the page cache.

Imported only by ``save`` and ``load``: DCP takes over a second to import.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.futures import Future

from .checksums import Span, crc_of_range, damage_message, mismatches
from .errors import CheckpointDamagedError


class _SummingStream:
    """A file opened for writing whose bytes between two ``tell()`` calls are summed:
    ``spans[(start, end)]`` is the CRC-32 of bytes ``[start, end)``."""

    def __init__(self, raw: Any, errors: list[BaseException]) -> None:
        self.raw, self.errors = raw, errors
        self.spans: dict[tuple[int, int], int] = {}
        self._start, self._crc = raw.tell(), 0

    def write(self, data: Any) -> int:
        try:
            n = self.raw.write(data)
        except (OSError, KeyboardInterrupt, SystemExit) as e:  # torch.save's archive writer
            self.errors.append(e)  # turns it into a RuntimeError ("unexpected pos"), which would
            raise  # read as a disk error: keep it, for the error message (an errno, an interrupt)
        view = memoryview(data).cast("B")
        self._crc = zlib.crc32(view if n is None or n == len(view) else view[:n], self._crc)
        return len(view) if n is None else n

    def tell(self) -> int:
        pos = self.raw.tell()
        if pos != self._start:
            self.spans[(self._start, pos)] = self._crc
            self._start, self._crc = pos, 0
        return pos

    def close(self) -> None:
        if not self.raw.closed:
            self.tell()
        self.raw.close()

    def __getattr__(self, name: str) -> Any:  # flush, fileno, closed, writable, ...
        return getattr(self.raw, name)


class _SummingFileSystem(FileSystem):
    """DCP's local file system, whose write streams sum what they write (per file name)."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: dict[str, dict[tuple[int, int], int]] = {}
        self.errors: list[BaseException] = []  # what the file system refused, in order

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            summing = _SummingStream(stream, self.errors)
            yield summing
            if not stream.closed:
                summing.tell()
        self.spans[os.path.basename(os.fspath(path))] = summing.spans


class Summed(NamedTuple):
    """A write result's storage info with the CRC-32 of its bytes (on its way to the
    coordinator; ``.metadata`` gets ``info`` alone)."""

    info: Any  # DCP's storage info: relative_path, offset, length
    crc: int


class ChecksumWriter(FileSystemWriter):
    """``FileSystemWriter`` (one file per rank, fsynced) that records each storage item's
    CRC-32; on the coordinator, after the save, ``checksums`` lists ``[file, offset, length,
    crc]`` for every item of every rank."""

    def __init__(self, path: str) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.fs = _SummingFileSystem()
        self.checksums: list[list[Any]] | None = None

    def write_data(self, plan: Any, planner: Any) -> Future:
        try:
            results = super().write_data(plan, planner).wait()
        except Exception as e:
            if self.fs.errors:  # the file system's own refusal (ENOSPC, EIO), or an interrupt
                raise self.fs.errors[0] from e
            raise
        summed = [dataclasses.replace(r, storage_data=Summed(r.storage_data,
                                                             self._crc(r.storage_data)))
                  for r in results]
        out: Future = Future()
        out.set_result(summed)
        return out

    def _crc(self, info: Any) -> int:
        spans = self.fs.spans.get(info.relative_path, {})
        measured = spans.get((info.offset, info.offset + info.length))
        if measured is not None:
            return measured
        return crc_of_range(os.path.join(self.path, info.relative_path), info.offset, info.length)

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        self.checksums = sorted([r.storage_data.info.relative_path, r.storage_data.info.offset,
                                 r.storage_data.info.length, r.storage_data.crc]
                                for rank in results for r in rank)
        plain = [[dataclasses.replace(r, storage_data=r.storage_data.info) for r in rank]
                 for rank in results]
        super().finish(metadata, plain)


class VerifyingReader(FileSystemReader):
    """``FileSystemReader`` that checks the CRC-32 of every storage item a rank's plan reads
    before DCP reads it; raises ``CheckpointDamagedError`` on a mismatch."""

    def __init__(self, path: str, checksums: dict[Span, int], rank: int) -> None:
        super().__init__(path)
        self.checksums, self.rank = checksums, rank

    def read_data(self, plan: Any, planner: Any) -> Future:
        spans: dict[Span, str] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            spans.setdefault((info.relative_path, info.offset, info.length), item.storage_index.fqn)
        bad = mismatches(os.fspath(self.path), spans, self.checksums)
        if bad:
            path = os.fspath(self.path)
            raise CheckpointDamagedError(damage_message(path, bad, f"rank {self.rank} read"),
                                         path, [self.rank])
        return super().read_data(plan, planner)
