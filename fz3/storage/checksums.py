"""A checksum for every storage item of a DCP checkpoint: computed from the bytes as they are
written (``dcp_io.py``), checked on the bytes a load reads and offline.

A *storage item* is the byte range ``[offset, offset + length)`` of one ``.distcp`` file that
DCP's ``FileSystemReader`` reads whole before it narrows it to what a rank needs (a tensor
chunk's ``torch.save`` archive, or a pickled value); the ranges tile each file. Keyed by
``(file, offset, length)``, a checksum serves any resharded load: a rank that needs part of an
item reads, and so checks, the whole item.

CRC-32 is ``zlib.crc32`` (about 5 GB/s on one core here; ``benchmarks/README.md`` has the cost
per GB of save and load): it catches every flipped bit and every burst of up to 32 bits, and
other damage with probability 1 - 2^-32. It is no defence against someone
who edits a file on purpose.
"""

from __future__ import annotations

import os
import zlib

ALGORITHM = "crc32"
_CHUNK = 16 << 20  # bytes read at a time when checking: bounded memory for any item size

Span = tuple[str, int, int]  # (file name inside the checkpoint, offset, length)


def crc_of_range(file: str, offset: int, length: int) -> int:
    """CRC-32 of ``length`` bytes of ``file`` from ``offset`` (fewer if the file is shorter)."""
    crc, buf = 0, bytearray(min(length, _CHUNK))
    view = memoryview(buf)
    with open(file, "rb", buffering=0) as f:
        f.seek(offset)
        left = length
        while left > 0:
            n = f.readinto(view[: min(left, len(buf))])
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            left -= n
    return crc


def crc_of_bytes(data: bytes) -> int:
    return zlib.crc32(data)


def mismatches(path: str, spans: dict[Span, str], checksums: dict[Span, int]) -> list[str]:
    """Each span (with the key it holds) whose bytes do not sum to the recorded CRC-32."""
    bad = []
    for (rel, offset, length), key in sorted(spans.items()):
        want = checksums.get((rel, offset, length))
        where = f"{rel} bytes [{offset}, {offset + length}) ({key})"
        if want is None:
            bad.append(f"{where} have no recorded checksum")
            continue
        got = crc_of_range(os.path.join(path, rel), offset, length)
        if got != want:
            bad.append(f"{where}: crc32 {got:08x}, saved as {want:08x}")
    return bad


def damage_message(path: str, bad: list[str], who: str) -> str:
    shown = "; ".join(bad[:8]) + (f"; and {len(bad) - 8} more" if len(bad) > 8 else "")
    return (f"checkpoint {path} is damaged: {who} {len(bad)} storage item(s) whose bytes changed "
            f"after the save (a flipped bit, a bad disk or an incomplete copy): {shown}. Load the "
            f"previous checkpoint (fz3.verify_checkpoint checks one offline), or save again")


def checksum_table(recorded: dict) -> dict[Span, int]:
    """fz3.json's ``checksums`` as ``{(file, offset, length): crc}``."""
    return {(rel, int(off), int(length)): int(crc) for rel, off, length, crc in recorded["items"]}
