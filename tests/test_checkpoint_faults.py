"""Checkpoints never lost and never silently wrong, with faults injected in real gloo ranks: a
save of a donated tree, flipped bits (at the saved world size and resharded), a disk that
fills up (injected and, as root, a real tmpfs), a rank killed inside DCP's write, a trailing
slash, a checkpoint from before checksums. Each test failed on the code before the fix."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import subprocess
import time

import pytest
import torch
import torch.distributed as tdist

import dist
import fz3
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from reference import batches, gpt

CFG = GPTConfig(vocab=37, seq=8, dim=36, heads=4, layers=3, tie=True)
FAST_S = 10.0  # every rank must end a failed save within this (the bound)


def _same(a: fz3.Params, b: fz3.Params) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parts, b.parts))


def _barrier(model) -> None:
    tdist.barrier(group=model.comm.group)


# --- a donated tree ----------------------------------------------------------------------------

def donated_ranks(rank, world, folder):
    model, params = shard_gpt(gpt(CFG))
    opt = fz3.optim.adamw(lr=1e-2)
    state = opt.init(params)
    path = os.path.join(folder, "ckpt")
    fz3.save(path, model, {"params": params, "opt": state})
    kept = fz3.Params(tuple(t.clone() for t in params.parts))
    loss, grads = fz3.value_and_grad(model)(params, batches(CFG, world)[rank])
    fresh_params, fresh_state = fz3.optim.step(opt, grads, state, params, donate=True)  # result kept aside
    for bad, key in (({"params": params, "opt": fresh_state}, "params.pre"),
                     ({"params": fresh_params, "opt": state}, "opt.mu.pre")):
        with pytest.raises(ValueError, match=rf"fz3.save: state\['{key}'\] was donated to "
                                             rf"fz3.optim.step\(..., donate=True\).*save what it returned"):
            fz3.save(path, model, bad)
        assert not os.path.exists(path + ".partial")
    loaded = fz3.load(path, model, {"params": fresh_params, "opt": opt.init(fresh_params)})
    assert _same(loaded["params"], kept)  # the earlier checkpoint, bitwise
    return "ok"


def test_save_refuses_donated_tree_and_keeps_the_checkpoint(tmp_path):
    """It returned normally, deleted the good checkpoint and left one that could not load."""
    assert dist.run(2, donated_ranks, str(tmp_path)) == ["ok"] * 2


# --- flipped bits --------------------------------------------------------------------------------

def _owner(path: str, file: str, offset: int) -> str:
    """The key whose storage item holds byte ``offset`` of ``file``, per DCP's metadata."""
    import torch.distributed.checkpoint as dcp

    for index, info in dcp.FileSystemReader(path).read_metadata().storage_data.items():
        if info.relative_path == file and info.offset <= offset < info.offset + info.length:
            return index.fqn
    raise AssertionError(f"byte {offset} of {file} is in no storage item")


def flip(path: str, file: str, offset: int, bit: int) -> None:
    with open(os.path.join(path, file), "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))


def flips(path: str, n: int, seed: int) -> list[tuple[str, int, int]]:
    """``n`` (file, offset, bit) spread over the data files and ``.metadata``, then 4 in
    ``fz3.json``: drawn afresh per seed, the seed in the test's output."""
    rng = random.Random(seed)
    files = sorted(f for f in os.listdir(path) if f.endswith(".distcp")) + [".metadata"]
    out = [(files[i % len(files)], 0, 0) for i in range(n)]
    out = [(f, rng.randrange(os.path.getsize(os.path.join(path, f))), rng.randrange(8)) for f, _, _ in out]
    return out + [("fz3.json", rng.randrange(os.path.getsize(os.path.join(path, "fz3.json"))),
                   rng.randrange(8)) for _ in range(4)]


def bitflip_ranks(rank, world, folder, seed, save):
    model, params = shard_gpt(gpt(CFG))
    opt = fz3.optim.adamw(lr=1e-2)
    path = os.path.join(folder, "ckpt")
    if save:
        fz3.save(path, model, {"params": params, "opt": opt.init(params), "step": 7})
    template = {"params": params, "opt": opt.init(params), "step": 0}
    cases = flips(path, 32, seed)
    read = set()  # the keys some rank's load reads: each rank's RNG only below the saved ranks
    with open(os.path.join(path, "fz3.json")) as f:
        saved_ranks = json.load(f)["ranks"]
    read |= {f"rng.rank{r}" for r in range(min(world, saved_ranks))}
    owners = [_owner(path, file, offset) if file.endswith(".distcp") else None for file, offset, _ in cases]
    undetected = []
    for (file, offset, bit), owner in zip(cases, owners):
        must = owner is None or not owner.startswith("rng.") or owner in read
        _barrier(model)
        if rank == 0:
            flip(path, file, offset, bit)
        _barrier(model)
        t0 = time.monotonic()
        try:
            fz3.load(path, model, template)
            caught = None
        except fz3.CheckpointDamagedError as e:
            caught = str(e)
        _barrier(model)  # every rank has read the flipped bit before rank 0 puts it back
        assert time.monotonic() - t0 < FAST_S
        if must and caught is None:
            undetected.append((file, offset, bit, owner))
        if not must:
            assert caught is None, (file, offset, owner, caught)  # an item nobody reads is no error
        if caught is not None:
            assert f"checkpoint {path} is damaged" in caught, caught
            if owner is not None:  # the file, the item (its key) and the rank that read it
                assert f"{file} bytes [" in caught and f"({owner})" in caught, caught
                assert "rank " in caught and " read " in caught, caught
        if rank == 0:
            with pytest.raises(fz3.CheckpointDamagedError, match="is damaged"):
                fz3.verify_checkpoint(path)
            flip(path, file, offset, bit)  # back as saved
    assert not undetected, undetected
    got = fz3.load(path, model, template)
    assert got["step"] == 7 and _same(got["params"], params)
    if rank == 0:
        assert fz3.verify_checkpoint(path).verified
    return len(cases)


@pytest.mark.parametrize("seed", [random.randrange(1 << 30)])
def test_bit_flips_are_detected_at_world_2_and_resharded_2_to_3(tmp_path, seed):
    """36 bits flipped one at a time (32 over both data files and .metadata, 4 in fz3.json):
    every one is named by load, at the saved world size and on a 2 -> 3 resharded load, and by
    verify_checkpoint. They loaded silently (a flip in a tensor's bytes trained on a wrong
    value)."""
    assert dist.run(2, bitflip_ranks, str(tmp_path), seed, True, timeout=240) == [36] * 2
    assert dist.run(3, bitflip_ranks, str(tmp_path), seed + 1, False, timeout=240) == [36] * 3


def unread_ranks(rank, world, folder, phase):
    model, params = shard_gpt(gpt(CFG))
    path = os.path.join(folder, "w3")
    if phase == "save":
        fz3.save(path, model, {"params": params})
        return "ok"
    if world == 2:  # rank 2's RNG state is damaged, and no rank reads it here
        assert _same(fz3.load(path, model, {"params": params})["params"], params)
    else:
        with pytest.raises(fz3.CheckpointDamagedError, match=r"rank 2 read 1 storage item.*\(rng.rank2\)"):
            fz3.load(path, model, {"params": params})
    return "ok"


def test_load_checks_exactly_what_it_reads(tmp_path):
    """A flip in rank 2's RNG state of a world-3 checkpoint: a world-2 load never reads it and
    loads; verify_checkpoint and a world-3 load name it."""
    folder = str(tmp_path)
    assert dist.run(3, unread_ranks, folder, "save") == ["ok"] * 3
    path = os.path.join(folder, "w3")
    import torch.distributed.checkpoint as dcp

    info = next(i for k, i in dcp.FileSystemReader(path).read_metadata().storage_data.items()
                if k.fqn == "rng.rank2")
    flip(path, info.relative_path, info.offset + info.length // 2, 3)
    with pytest.raises(fz3.CheckpointDamagedError, match=r"\(rng.rank2\): crc32"):
        fz3.verify_checkpoint(path)  # offline: this process has no process group
    assert dist.run(2, unread_ranks, folder, "load") == ["ok"] * 2
    assert dist.run(3, unread_ranks, folder, "load") == ["ok"] * 3


# --- faults while saving: disk full, a bad path, a dead rank ---------------------------------------

class _FailWhilePickled:
    """Raises ``OSError(errno)`` when DCP serialises it: a write failing inside DCP's data write."""

    def __init__(self, code: int):
        self.code = code

    def __reduce__(self):
        raise OSError(self.code, os.strerror(self.code))


def _expect_save_error(model, path, state, ranks, text):
    t0 = time.monotonic()
    with pytest.raises(fz3.CheckpointError) as e:
        fz3.save(path, model, state)
    took = time.monotonic() - t0
    assert took < FAST_S, took
    msg = str(e.value)
    assert f"fz3.save('{path}') failed" in msg and f"rank(s) {ranks}" in msg and text in msg, msg
    assert e.value.ranks == ranks and e.value.path == path, (e.value.ranks, e.value.path)
    assert not isinstance(e.value, ValueError)  # a save failure is not damage
    return msg


def disk_full_ranks(rank, world, folder):
    import fz3.storage.checkpoint as checkpoint

    model, params = shard_gpt(gpt(CFG))
    path = os.path.join(folder, "ckpt")
    fz3.save(path, model, {"params": params, "step": 1})
    new = fz3.Params(tuple(t + 1 for t in params.parts))
    full = "ENOSPC: No space left on device"

    def intact():
        _barrier(model)
        got = fz3.load(path, model, {"params": params, "step": 0})
        assert got["step"] == 1 and _same(got["params"], params)
        assert sorted(os.listdir(folder)) == ["ckpt"], os.listdir(folder)  # no .partial left
        _barrier(model)  # every rank has looked before rank 0 makes anything new
    # The data write fails on rank 1 only, then on every rank.
    for failing in ([1], [0, 1]):
        bomb = _FailWhilePickled(errno.ENOSPC) if rank in failing else 0
        # a key per rank: a value under one key is written by one rank only (DCP dedups it)
        _expect_save_error(model, path, {"params": new, "step": 2, f"x{rank}": bomb}, failing, full)
        intact()
    # Rank 0's last small file (fz3.json) only: the others used to wait the whole timeout.
    real = checkpoint.write_durably

    def no_space(file, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file)
    if rank == 0:
        checkpoint.write_durably = no_space  # the injected fault: this rank's process only
    try:
        msg = _expect_save_error(model, path, {"params": new, "step": 2}, [0], full)
        assert "writing fz3.json" in msg and "fz3.json" in msg, msg
    finally:
        checkpoint.write_durably = real
    intact()
    # A path under a file: rank 0's claim of the path fails (ENOTDIR), every rank says so.
    if rank == 0:
        open(os.path.join(folder, "afile"), "w").close()
    _barrier(model)
    bad = os.path.join(folder, "afile", "ckpt")
    _expect_save_error(model, bad, {"params": new}, [0], "ENOTDIR: Not a directory")
    _barrier(model)
    if rank == 0:
        os.remove(os.path.join(folder, "afile"))
    intact()
    # A retry into the same folder works.
    fz3.save(path, model, {"params": new, "step": 2})
    got = fz3.load(path, model, {"params": params, "step": 0})
    assert got["step"] == 2 and _same(got["params"], new)
    return "ok"


def test_save_failures_end_every_rank_fast_with_the_cause(tmp_path):
    """Disk full in the data write (one rank, every rank), in rank 0's fz3.json, a bad path:
    every rank raises CheckpointError naming the failing ranks, the path and the errno text
    within 10 s, the previous checkpoint loads bitwise, no .partial is left, a retry works.
    (It was DCP's cause-less CheckpointException, or rank 0's OSError while rank 1 waited the
    arrival timeout, 120 s by default.)"""
    assert dist.run(2, disk_full_ranks, str(tmp_path), timeout=180) == ["ok"] * 2


def _first_save(folder, phase):
    """The model, its params and the checkpoint path; the good checkpoint (step 1) saved in
    phase "first"."""
    model, params = shard_gpt(gpt(CFG))
    path = os.path.join(folder, "ckpt")
    if phase == "first":
        fz3.save(path, model, {"params": params, "step": 1})
    return model, params, path


def tmpfs_ranks(rank, world, folder, phase):
    model, params, path = _first_save(folder, phase)
    if phase == "first":
        return "ok"
    if phase == "full":
        bigger = {"params": params, "step": 2, "extra": torch.zeros(4 << 20, dtype=torch.uint8)}
        t0 = time.monotonic()
        with pytest.raises(fz3.CheckpointError, match=rf"fz3.save\('{path}'\) failed writing the data on "
                                                      rf"rank\(s\) \[.*ENOSPC: No space left on device") as e:
            fz3.save(path, model, bigger)
        assert time.monotonic() - t0 < FAST_S and e.value.ranks, e.value.ranks
    got = fz3.load(path, model, {"params": params, "step": 0})
    assert got["step"] == 1 and _same(got["params"], params)
    return "ok"


def test_a_real_full_disk(tmp_path):
    """A 1 MiB tmpfs holding a checkpoint of ~0.25 MiB; the next save adds 4 MiB per rank: the
    real ENOSPC on every rank, named on every rank, the old checkpoint intact."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:  # needs root (CAP_SYS_ADMIN): the injected faults above run anyway
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        assert dist.run(2, tmpfs_ranks, str(small), "first") == ["ok"] * 2
        assert dist.run(2, tmpfs_ranks, str(small), "full") == ["ok"] * 2
        assert sorted(os.listdir(small)) == ["ckpt"]
    finally:
        subprocess.run(["umount", str(small)], check=True)


class _DieWhilePickled:
    """Kills its rank when DCP serialises it: in the middle of DCP's data write."""

    def __reduce__(self):
        os._exit(17)


def killed_ranks(rank, world, folder, phase):
    model, params, path = _first_save(folder, phase)
    if phase == "first":
        return "ok"
    if phase == "kill":
        state = {"params": fz3.Params(tuple(t + 1 for t in params.parts)), "step": 2,
                 f"bomb{rank}": _DieWhilePickled() if rank == 1 else 0}  # a key per rank: one value per key
        t0 = time.monotonic()
        with pytest.raises(fz3.RankLostError, match=r"fz3.save\(.*\) \(writing the data\) failed: "
                                                    r"rank\(s\) \[1\] stopped responding") as e:
            fz3.save(path, model, state)
        assert e.value.lost == [1] and time.monotonic() - t0 < FAST_S, (e.value.lost, time.monotonic() - t0)
        return "named"
    got = fz3.load(path, model, {"params": params, "step": 0})
    assert got["step"] == 1 and _same(got["params"], params)
    return "ok"


def test_a_rank_killed_inside_the_dcp_write_is_named(tmp_path):
    """Rank 1 dies inside DCP's write: rank 0 raises RankLostError naming it within 10 s (it
    got gloo's raw 'Connection closed by peer'); the previous checkpoint still loads."""
    folder = str(tmp_path)
    assert dist.run(2, killed_ranks, folder, "first") == ["ok"] * 2
    out = dist.run(2, killed_ranks, folder, "kill", may_die=frozenset({1}), timeout=120,
                   env={"FZ3_TEST_PG_TIMEOUT": "60"})
    assert out == ["named", None], out
    assert dist.run(2, killed_ranks, folder, "check") == ["ok"] * 2


# --- paths and old checkpoints -------------------------------------------------------------------

def slash_ranks(rank, world, folder):
    model, params = shard_gpt(gpt(CFG))
    path = os.path.join(folder, "dir", "ckpt") + "/"
    for step in (1, 2):  # the second replaces the first
        fz3.save(path, model, {"params": params, "step": step})
    assert fz3.load(path, model, {"params": params, "step": 0})["step"] == 2
    assert fz3.load(path.rstrip("/"), model, {"params": params, "step": 0})["step"] == 2
    fz3.export(os.path.join(folder, "exp") + "/", model, params)
    _barrier(model)
    assert sorted(os.listdir(os.path.join(folder, "dir"))) == ["ckpt"]
    assert not any(f.endswith(".partial") for f in os.listdir(path))
    return "ok"


def test_trailing_slash(tmp_path):
    """save('dir/ckpt/') could never succeed (EINVAL on rank 0, rank 1 blaming rank 0 as
    dead, a .partial left inside the good checkpoint)."""
    assert dist.run(2, slash_ranks, str(tmp_path)) == ["ok"] * 2
    assert fz3.verify_checkpoint(str(tmp_path / "dir" / "ckpt") + "/").verified


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def old_format_ranks(rank, world, folder):
    model, params = shard_gpt(gpt(CFG))
    path = os.path.join(folder, "old")
    fz3.save(path, model, {"params": params, "step": 5})
    _barrier(model)
    meta_file = os.path.join(path, "fz3.json")
    with open(meta_file) as f:
        text = f.read()
    _barrier(model)
    if rank == 0:  # one flipped bit in a key: "crc32" -> "crc33" (it had turned the check off)
        with open(meta_file, "w") as f:
            f.write(text.replace('"crc32"', '"crc33"'))
    _barrier(model)
    with pytest.raises(fz3.CheckpointDamagedError, match=r"has one of 'crc32' and 'checksums' without the other"):
        fz3.load(path, model, {"params": params, "step": 0})
    _barrier(model)
    if rank == 0:
        with open(meta_file, "w") as f:
            f.write(text)
    _barrier(model)
    if rank == 0:  # as fz3 wrote it before checksums: no checksums, no crc of itself
        meta_file = os.path.join(path, "fz3.json")
        with open(meta_file) as f:
            meta = json.load(f)
        del meta["checksums"], meta["crc32"]
        with open(meta_file, "w") as f:
            json.dump(meta, f)
    _barrier(model)
    lines = _Lines()
    logging.getLogger("fz3").addHandler(lines)
    got = fz3.load(path, model, {"params": params, "step": 0})
    assert got["step"] == 5 and _same(got["params"], params)
    said = [s for s in lines.lines if "cannot be verified" in s]
    assert len(said) == (1 if rank == 0 else 0), lines.lines
    assert f"checkpoint {path} has no checksums" in said[0] if said else True
    _barrier(model)
    if rank == 0:  # contents that do not decode, in a checkpoint that cannot say which bytes changed
        data = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
        size = os.path.getsize(os.path.join(path, data))
        with open(os.path.join(path, data), "wb") as f:
            f.write(b"\xff" * size)
        report = fz3.verify_checkpoint(path)
        assert not report.verified and report.items > 0, report
    _barrier(model)
    with pytest.raises(fz3.CheckpointDamagedError, match=r"is damaged inside a file, or the storage failed: its "
                                                         r"files have their full length") as e:
        fz3.load(path, model, {"params": params, "step": 0})
    assert isinstance(e.value, ValueError)  # except ValueError, as before, still catches it
    return "ok"


def test_a_checkpoint_from_before_checksums_loads_with_one_line(tmp_path):
    assert dist.run(2, old_format_ranks, str(tmp_path)) == ["ok"] * 2
