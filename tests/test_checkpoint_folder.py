"""A checkpoint folder is the user's (issue 51): save touches only its own files and claims the
path against another job's save, every rank loads the same checkpoint or every rank raises
(races forced by placing a writer's swap between two ranks' looks, or between the ranks'
agreement and their read), per-rank values are refused by key, interrupts are named. Each
check failed on the code before the fix; all of them share one group of two gloo ranks."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch
import torch.distributed as tdist

import dist
import fz3
from fz3.comm.compat import default_store
from fz3.models import shard_gpt
from fz3.models.gpt import GPTConfig
from fz3.storage import agreement, dcp_io, owned
from reference import gpt

CFG = GPTConfig(vocab=37, seq=8, dim=36, heads=4, layers=3, tie=True)
FAST_S = 10.0  # every rank must raise within this (a killed rank is named within 3 s)


def _barrier(model) -> None:
    tdist.barrier(group=model.comm.group)


def _signal(key: str) -> None:
    default_store().set(key, "1")


def _wait(key: str) -> None:
    default_store().wait([key], datetime.timedelta(seconds=60))


def _step(model, params, path) -> int:
    return fz3.load(path, model, {"params": params, "step": 0})["step"]


def _listing(folder: str) -> dict:
    return {n: sorted(os.listdir(os.path.join(folder, n))) if os.path.isdir(os.path.join(folder, n))
            else open(os.path.join(folder, n)).read() for n in sorted(os.listdir(folder))}


def own_files_checks(model, params, folder, rank):
    """Save replaces only an fz3 checkpoint; load reads only fz3's marked backup."""
    ckpt = os.path.join(folder, "ckpt")
    # A folder of the user's things, a file at the path, a checkpoint with a file added: each
    # refused on every rank, naming what is there; nothing of it changed (it was deleted).
    out, afile = os.path.join(folder, "out"), os.path.join(folder, "afile")
    if rank == 0:
        os.makedirs(os.path.join(out, "export"))
        open(os.path.join(out, "notes.txt"), "w").write("mine")
        open(afile, "w").write("mine")
    _barrier(model)
    before = _listing(folder)
    for path, said in ((out, r"holds \['export', 'notes.txt'\] and no fz3.json"),
                       (afile, r"afile is a file, not an fz3 checkpoint")):
        with pytest.raises(FileExistsError, match=said):
            fz3.save(path, model, {"params": params, "step": 1})
    assert _listing(folder) == before
    fz3.save(ckpt, model, {"params": params, "step": 1})
    _barrier(model)
    if rank == 0:
        open(os.path.join(ckpt, "mine.txt"), "w").write("mine")
    _barrier(model)
    with pytest.raises(FileExistsError, match=r"holding files fz3 did not write: \['mine.txt'\]"):
        fz3.save(ckpt, model, {"params": params, "step": 2})
    assert _step(model, params, ckpt) == 1
    _barrier(model)
    if rank == 0:
        os.remove(os.path.join(ckpt, "mine.txt"))
        os.makedirs(os.path.join(folder, "empty"))
    _barrier(model)
    fz3.save(os.path.join(folder, "empty"), model, {"params": params, "step": 3})  # nothing to lose
    assert _step(model, params, os.path.join(folder, "empty")) == 3
    # The user's own ckpt.old (mv ckpt ckpt.old): load("ckpt") does not read it, save does not
    # delete it; either says so, on every rank.
    _barrier(model)
    if rank == 0:
        os.rename(ckpt, ckpt + ".old")
        open(os.path.join(folder, "beside.txt"), "w").write("mine")
    _barrier(model)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*ckpt: nothing is there; .*ckpt.old exists "
                                                r"but is not fz3's backup"):
        fz3.load(ckpt, model, {"params": params, "step": 0})
    with pytest.raises(FileExistsError, match=r"ckpt.old exists and is not fz3's backup"):
        fz3.save(ckpt, model, {"params": params, "step": 2})
    assert _step(model, params, ckpt + ".old") == 1
    assert not os.path.exists(ckpt) and not os.path.exists(ckpt + ".partial")
    # An unmarked ckpt.partial (the user's, or left by the previous release): refused, kept.
    _barrier(model)
    if rank == 0:
        os.rename(ckpt + ".old", ckpt)
        os.makedirs(ckpt + ".partial")
        open(os.path.join(ckpt + ".partial", "keep.txt"), "w").write("mine")
    _barrier(model)
    with pytest.raises(FileExistsError, match=r"ckpt.partial exists without fz3's claim mark"):
        fz3.save(ckpt, model, {"params": params, "step": 2})
    assert os.listdir(ckpt + ".partial") == ["keep.txt"]
    _barrier(model)
    if rank == 0:
        shutil.rmtree(ckpt + ".partial")
        # A save that crashed between its renames: only the marked backup is there.
        owned.mark_backup(ckpt, "crashed")
        os.rename(ckpt, ckpt + ".old")
    _barrier(model)
    assert _step(model, params, ckpt) == 1  # the marked backup
    fz3.save(ckpt, model, {"params": params, "step": 2})  # and the next save removes it
    assert _step(model, params, ckpt) == 2 and not os.path.exists(ckpt + ".old")
    # A symlink to a checkpoint is followed by both; the link stays a link.
    _barrier(model)
    link = os.path.join(folder, "link")
    if rank == 0:
        os.symlink(ckpt, link)
    _barrier(model)
    fz3.save(link, model, {"params": params, "step": 5})
    assert os.path.islink(link) and _step(model, params, link) == 5 and _step(model, params, ckpt) == 5
    assert open(os.path.join(folder, "beside.txt")).read() == "mine"


def claim_checks(model, params, folder, rank):
    """One save per path: a live claim is refused at once, a dead process's is taken over."""
    ckpt = os.path.join(folder, "claimed")
    fz3.save(ckpt, model, {"params": params, "step": 1})
    partial = ckpt + ".partial"
    _barrier(model)
    if rank == 0:  # another job's save in flight: this rank's parent process holds the claim
        theirs = owned.claim(partial, "theirs")
        with open(theirs.file) as f:
            holder = json.load(f)
        holder.update(pid=os.getppid(), start=owned._start_time(os.getppid()))
        with open(theirs.file, "w") as f:
            json.dump(holder, f)
    _barrier(model)
    t0 = time.monotonic()
    with pytest.raises(FileExistsError, match=rf"another save is writing into this path: .*claimed.partial is claimed "
                                              rf"by save theirs of process {os.getppid()} on host"):
        fz3.save(ckpt, model, {"params": params, "step": 2})
    assert time.monotonic() - t0 < FAST_S
    assert os.listdir(partial) == ["fz3.claim.0"] and _step(model, params, ckpt) == 1
    _barrier(model)
    if rank == 0:  # the job was killed: its process is gone (a real process, exited and reaped)
        gone = subprocess.Popen(["true"])
        gone.wait()
        with open(os.path.join(partial, "fz3.claim.0"), "w") as f:
            json.dump({**holder, "pid": gone.pid, "start": "1"}, f)
        open(os.path.join(partial, "__0_0.distcp"), "w").write("half a save")
    _barrier(model)
    fz3.save(ckpt, model, {"params": params, "step": 2})
    assert _step(model, params, ckpt) == 2 and not os.path.exists(partial)


def per_rank_checks(model, params, folder, rank):
    """A value that differs between ranks is refused by key; under a key per rank it comes
    back per rank; each rank's RNG state comes back as its own."""
    path = os.path.join(folder, "per_rank")
    for state, key in (({"params": params, "pos": 1000 + rank}, "pos"),
                       ({"params": params, "t": torch.tensor([rank])}, "t")):
        with pytest.raises(ValueError, match=rf"state\['{key}'\] differs between ranks \(rank 0: .*; rank 1: "):
            fz3.save(path, model, state)
    assert not os.path.exists(path)
    torch.manual_seed(7 + rank)
    fz3.save(path, model, {"params": params, f"pos.rank{rank}": 1000 + rank})
    want = torch.rand(3)
    got = fz3.load(path, model, {"params": params, f"pos.rank{rank}": 0})
    assert got[f"pos.rank{rank}"] == 1000 + rank and torch.equal(torch.rand(3), want)


def cwd_checks(model, params, folder, rank):
    """A relative path read from different working directories names the folders."""
    here = os.getcwd()
    mine = os.path.join(folder, f"cwd{rank}")
    os.makedirs(mine)
    os.chdir(mine)
    try:
        with pytest.raises(ValueError, match=r"resolved the path to different folders \(rank 0: .*cwd0/rel, "
                                             r"rank 1: .*cwd1/rel\)"):
            fz3.save("rel", model, {"params": params})
        with pytest.raises(fz3.CheckpointMismatchError, match=r"resolved the path to different folders"):
            fz3.load("rel", model, {"params": params})
    finally:
        os.chdir(here)


def _swap(path: str, other: str) -> None:
    """What a writer's commit does to a reader: the checkpoint at ``path`` replaced by another."""
    os.rename(path, path + ".was")
    os.rename(other, path)
    os.rename(path + ".was", other)


def race_checks(model, params, folder, rank, case):
    """A reader racing a writer, with the writer's swap forced between the two ranks' looks,
    or between the ranks' agreement and their read."""
    ckpt, other = os.path.join(folder, "race"), os.path.join(folder, "race_next")
    fz3.save(ckpt, model, {"params": params, "step": 4})
    fz3.save(other, model, {"params": params, "step": 2})
    real_source, real_meta = agreement.source, agreement.read_meta
    real_read = dcp_io.VerifyingReader.read_data
    if case in ("between looks", "gone"):  # rank 0 looks, the writer acts, rank 1 looks
        def source(path):
            if rank == 1:
                _wait("race/swapped")
            return real_source(path)

        def read_meta(path):
            got = real_meta(path)
            if rank == 0:
                _swap(ckpt, other) if case == "between looks" else os.rename(ckpt, ckpt + ".moved")
                _signal("race/swapped")
            return got
        agreement.source, agreement.read_meta = source, read_meta
        said = (r"did not all find the same checkpoint \(rank 0: checkpoint save \w+ .*; rank 1: checkpoint save \w+"
                if case == "between looks" else
                r"did not all find the same checkpoint \(rank 0: checkpoint save .*; rank 1: FileNotFoundError")
    else:  # "during the read": both agreed, then the writer swaps before either reads
        def read_data(self, plan, planner):
            _signal(f"race/ready{rank}")
            if rank == 0:
                _wait("race/ready1")
                _swap(ckpt, other)
                _signal("race/swapped")
            _wait("race/swapped")
            return real_read(self, plan, planner)
        dcp_io.VerifyingReader.read_data = read_data
        said = r"race changed while loading \(another job saving here\?\)"
    t0 = time.monotonic()
    try:
        with pytest.raises(fz3.CheckpointMismatchError, match=said):
            fz3.load(ckpt, model, {"params": params, "step": 0})
    finally:
        agreement.source, agreement.read_meta = real_source, real_meta
        dcp_io.VerifyingReader.read_data = real_read
    assert time.monotonic() - t0 < FAST_S
    return "ok"


class _InterruptWhilePickled:
    """Sends SIGINT to its own rank when DCP serialises it: Ctrl-C in the middle of the write."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the KeyboardInterrupt arrives here
        raise AssertionError("no KeyboardInterrupt")


def interrupt_checks(model, params, folder, rank):
    """Ctrl-C on rank 1 during save, then during load: rank 1 raises its KeyboardInterrupt,
    rank 0 RankInterruptedError naming it (it was a disk error, and a damaged checkpoint)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    path = os.path.join(folder, "interrupted")
    fz3.save(path, model, {"params": params, "step": 1})
    for call in ("save", "load"):
        real_read = dcp_io.VerifyingReader.read_data
        if call == "save":
            state = {"params": params, "step": 2, f"x{rank}": _InterruptWhilePickled() if rank == 1 else 0}
            run = lambda: fz3.save(path, model, state)  # noqa: E731
        else:
            def read_data(self, plan, planner):
                if rank == 1:
                    _InterruptWhilePickled().__reduce__()
                return real_read(self, plan, planner)
            dcp_io.VerifyingReader.read_data = read_data
            run = lambda: fz3.load(path, model, {"params": params, "step": 0})  # noqa: E731
        t0 = time.monotonic()
        try:
            if rank == 1:
                with pytest.raises(KeyboardInterrupt):
                    run()
            else:
                with pytest.raises(fz3.RankInterruptedError, match=rf"fz3.{call}\(.*\) .*stopped: rank\(s\) \[1\] "
                                                                   rf"were interrupted \(rank 1: KeyboardInterrupt\)"):
                    run()
        finally:
            dcp_io.VerifyingReader.read_data = real_read
        assert time.monotonic() - t0 < FAST_S
        assert _step(model, params, path) == 1 and sorted(os.listdir(folder)) == ["interrupted"]


def folder_ranks(rank, world, folder):
    model, params = shard_gpt(gpt(CFG))
    for i, checks in enumerate((own_files_checks, claim_checks, per_rank_checks, cwd_checks)):
        sub = os.path.join(folder, str(i))
        os.makedirs(sub, exist_ok=True)
        _barrier(model)
        checks(model, params, sub, rank)
    for i, case in enumerate(("between looks", "gone", "during the read")):
        sub = os.path.join(folder, f"race{i}")
        os.makedirs(sub, exist_ok=True)
        _barrier(model)
        race_checks(model, params, sub, rank, case)
        default_store().delete_key("race/swapped")
    sub = os.path.join(folder, "intr")
    os.makedirs(sub, exist_ok=True)
    _barrier(model)
    interrupt_checks(model, params, sub, rank)
    return "ok"


def test_a_checkpoint_folder_is_the_users(tmp_path):
    assert dist.run(2, folder_ranks, str(tmp_path), timeout=120) == ["ok"] * 2
