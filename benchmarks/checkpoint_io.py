"""What checksums cost a checkpoint: DCP's save and load of the same state with fz3's
``ChecksumWriter`` / ``VerifyingReader`` against DCP's plain ``FileSystemWriter`` /
``FileSystemReader``, as interleaved pairs (medians), per GB, at world size 1.

    python benchmarks/checkpoint_io.py --mib 1024 --pairs 5 --dir /tmp/ckpt-bench

Both writers fsync every file (DCP's default), so "save" includes the disk; a load right
after a save reads from the page cache, the case where the checksum's share is largest.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fz3.storage.checksums import checksum_table
from fz3.storage.dcp_io import ChecksumWriter, VerifyingReader


def state(mib: int) -> dict[str, torch.Tensor]:
    """``mib`` MiB of fp32 in 16 tensors (one per unit, as a sharded model's parts)."""
    per = (mib << 20) // 16 // 4
    g = torch.Generator().manual_seed(0)
    return {f"part{i}": torch.randn(per, generator=g) for i in range(16)}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="state size in MiB")
    ap.add_argument("--pairs", type=int, default=5, help="interleaved (plain, checked) pairs")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="fz3-ckpt-bench-")
    os.makedirs(root, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1)
    sd = state(args.mib)
    gb = sum(t.numel() * t.element_size() for t in sd.values()) / 1e9
    rows: dict[str, list[float]] = {k: [] for k in ("save plain", "save checked", "load plain", "load checked")}
    for i in range(args.pairs):
        for kind in (("plain", "checked") if i % 2 == 0 else ("checked", "plain")):  # ABBA: drift cancels
            path = os.path.join(root, kind)
            shutil.rmtree(path, ignore_errors=True)
            writer = dcp.FileSystemWriter(path) if kind == "plain" else ChecksumWriter(path)
            rows[f"save {kind}"].append(timed(lambda: dcp.save(sd, storage_writer=writer)))
            if kind == "plain":
                reader = dcp.FileSystemReader(path)
            else:
                table = checksum_table({"items": writer.checksums})
                reader = VerifyingReader(path, table, 0)
            into = {k: torch.empty_like(t) for k, t in sd.items()}
            rows[f"load {kind}"].append(timed(lambda: dcp.load(into, storage_reader=reader)))
            assert all(torch.equal(into[k], sd[k]) for k in sd)
    med = {k: statistics.median(v) for k, v in rows.items()}
    import zlib

    crc = statistics.median(timed(lambda: [zlib.crc32(t.numpy().data) for t in sd.values()]) for _ in range(3))
    print(f"torch {torch.__version__}, {gb:.2f} GB, {args.pairs} interleaved pairs, medians; "
          f"zlib.crc32 alone {crc / gb:.3f} s/GB:")
    for op in ("save", "load"):
        plain, checked = med[f"{op} plain"], med[f"{op} checked"]
        print(f"  {op}: plain {plain / gb:.3f} s/GB, checked {checked / gb:.3f} s/GB, "
              f"checksums +{(checked - plain) / gb:.3f} s/GB ({checked / plain:.2f}x)")
    dist.destroy_process_group()
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
