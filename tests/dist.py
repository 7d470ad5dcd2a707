"""Run a function on N real processes joined by a gloo process group on 127.0.0.1.

Each rank runs ``fn(rank, world_size, *args)`` with one thread; what it returns travels back
pickled as plain Python/numpy values (tensors through a multiprocessing queue travel as
shared-memory handles that die with the child, so ranks return numbers or bytes). The first
failing rank's traceback is raised in the test process; a rank that hangs is killed at the
timeout and reported as such.

Ranks are forked from a forkserver that imported torch, fz3, dynamo, torch's checkpoint and
Hugging Face modules once (``spawn`` would import them again in every rank: ~3 s of CPU
each, which on 2 cores was more than half of the suite). The server never runs a torch op,
so no thread pool exists when it forks; every rank still builds its own process group.

``Pool`` keeps ranks (and their process group) up across many tasks, for property tests
whose examples each cost less than starting ranks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a child's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(*args: str, timeout: float = 240, env: dict | None = None) -> str:
    """``python *args`` from the repository root with one thread, warnings off and a free
    ``MASTER_PORT`` (not the caller's nor a script's fixed default, either may be taken; ``env``
    entries override all of these). Asserts it exits 0 (the tails of its output in the
    message) and returns its stdout."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "MASTER_PORT": str(free_port()), **(env or {})}
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def _init_rank(rank: int, world: int, store: str, env: dict) -> None:
    """This process as rank ``rank``: its environment, one thread, a gloo process group."""
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.update(env)
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=float(env.get("FZ3_TEST_PG_TIMEOUT", 300)))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timeout)


def _child(fn: Callable, rank: int, world: int, store: str, q: Any, args: tuple, env: dict) -> None:
    import torch.distributed as dist

    try:
        _init_rank(rank, world, store, env)
        out = fn(rank, world, *args)
        q.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - report everything to the parent, before any teardown
        q.put((rank, False, traceback.format_exc()))
        return
    dist.destroy_process_group()


_HERE = os.path.dirname(os.path.abspath(__file__))
_CTX = mp.get_context("forkserver")
# Modules not installed are skipped by the server. The test modules are preloaded too: a
# rank unpickles its function by importing the function's module.
_CTX.set_forkserver_preload(
    ["torch", "torch.distributed", "torch.distributed.checkpoint", "fz3", "transformers", "peft",
     # make_fx (fz3's traced layers) imports the rest of dynamo at a rank's first trace
     # (first trace in a rank 0.48 s without this, 0.43 s with it)
     "torch._dynamo",
     *(f"transformers.models.{m}.modeling_{m}" for m in ("gpt2", "llama", "roberta")),
     *sorted(f[:-3] for f in os.listdir(_HERE) if f.startswith("test_") and f.endswith(".py"))])


def run(world: int, fn: Callable, *args: Any, timeout: float = 180.0, env: dict | None = None,
        may_die: frozenset[int] = frozenset()) -> list[Any]:
    """Run ``fn`` on ``world`` ranks; return the list of results, by rank (None for a rank in
    ``may_die`` that exited without reporting, as a test that kills it expects)."""
    ctx = _CTX
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(fn, r, world, store, q, args, env or {}), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            dead_since: dict[int, float] = {}
            while len(results) < world:
                try:
                    rank, ok, out = q.get(timeout=0.5)
                except queue.Empty:
                    missing = sorted(set(range(world)) - set(results))
                    for r in missing:  # a rank that died without a report (killed, os._exit, crash)
                        if r in may_die and procs[r].exitcode is not None:
                            results[r] = None
                        elif procs[r].exitcode is not None and time.monotonic() - dead_since.setdefault(r, time.monotonic()) > 2:
                            raise AssertionError(f"rank {r} exited with code {procs[r].exitcode} without a report; "
                                                 f"finished ranks returned {results}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"ranks {missing} of {world} did not finish within {timeout}s (hang?)") from None
                    continue
                if not ok:
                    failed = _failures(q, world, {rank: out})
                    dead = [f"rank {r} exited with code {p.exitcode} without a report"
                            for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in failed]
                    raise AssertionError("\n".join(dead + [failed[r] for r in sorted(failed)]))
                results[rank] = out
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [results[r] for r in range(world)]


def _pool_child(rank: int, world: int, store: str, inbox: Any, q: Any, env: dict) -> None:
    """A rank that keeps its process group and runs one task after another from ``inbox``."""
    import torch.distributed as dist

    _init_rank(rank, world, store, env)
    while (task := inbox.get()) is not None:
        fn, args = task
        try:
            q.put((rank, True, fn(rank, world, *args)))
        except BaseException:  # noqa: BLE001 - reported; the rank stays for the next task
            q.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class Pool:
    """``world`` ranks started once, running many tasks: ``pool.run(fn, *args)`` runs
    ``fn(rank, world, *args)`` on every rank and returns the results by rank. For many small
    cases (a property test's examples) where starting ranks would cost more than the cases.

    A task that fails on any rank, or hangs past ``timeout``, may have left the other ranks
    inside a collective: the pool then replaces its ranks with fresh ones (their own process
    group) and raises AssertionError with every failing rank's traceback, or TimeoutError.
    So a failure costs one restart (a few seconds) and the next task starts clean."""

    def __init__(self, world: int, env: dict | None = None) -> None:
        self.world, self._env = world, env or {}
        self._start()

    def _start(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self._q = _CTX.Queue()
        self._inboxes = [_CTX.Queue() for _ in range(self.world)]
        store = os.path.join(self._tmp.name, "store")
        self._procs = [_CTX.Process(target=_pool_child, daemon=True,
                                    args=(r, self.world, store, self._inboxes[r], self._q,
                                          self._env))
                       for r in range(self.world)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable, *args: Any, timeout: float = 60.0,
            grace: float = 2.0) -> list[Any]:
        for inbox in self._inboxes:
            inbox.put((fn, args))
        results: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world and time.monotonic() < deadline:
            if any(not ok for ok, _ in results.values()):  # the others get `grace` to report
                deadline = min(deadline, time.monotonic() + grace)
            try:
                rank, ok, out = self._q.get(timeout=0.2)
            except queue.Empty:
                if any(p.exitcode is not None for p in self._procs):
                    break
                continue
            results[rank] = (ok, out)
        failed = {r: out for r, (ok, out) in results.items() if not ok}
        if len(results) == self.world and not failed:
            return [results[r][1] for r in range(self.world)]
        self.close()
        self._start()
        silent = sorted(set(range(self.world)) - set(results))
        if not failed:
            raise TimeoutError(f"ranks {silent} of {self.world} did not finish "
                               f"{fn.__name__}{args} within {timeout}s, or died")
        stuck = [f"ranks {silent} did not report (stuck after it?)"] if silent else []
        raise AssertionError("\n".join([f"rank {r} of {self.world} failed:\n{msg}"
                                        for r, msg in sorted(failed.items())] + stuck))

    def close(self) -> None:
        for inbox, p in zip(self._inboxes, self._procs):
            if p.is_alive():
                inbox.put(None)
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        self._tmp.cleanup()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _failures(q: Any, world: int, failed: dict[int, str]) -> dict[int, str]:
    """Every rank's failure (the first one to arrive is often a consequence of another's)."""
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        try:
            rank, ok, out = q.get(timeout=0.2)
        except queue.Empty:
            continue
        if not ok:
            failed[rank] = out
    return {r: f"rank {r} of {world} failed:\n{msg}" for r, msg in failed.items()}
