"""Multi-node launch for real: the GPT example as two torchrun "nodes" of 2 ranks each on this
machine (c10d rendezvous on 127.0.0.1), against the single-node world-size-4 run: the same
losses, bit for bit (same ranks, same data, same arithmetic). Hybrid sharding (one replica
per node) is the same launch with ``--replicate 2``; tests/test_hybrid.py checks its numbers."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from torch.distributed import TCPStore

from dist import ROOT, free_port

ARGS = ["examples/train_gpt.py", "--steps", "6", "--log-every", "1", "--layers", "2", "--dim", "64"]


def _losses(out: str) -> list[str]:
    return re.findall(r"step +\d+  loss (\d+\.\d+)", out)


def _torchrun(*launch: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launch, *ARGS], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_nodes_match_one_node():
    single = _torchrun("--standalone", "--nproc-per-node", "4")
    ref, _ = single.communicate(timeout=240)
    assert single.returncode == 0, ref[-3000:]
    assert len(_losses(ref)) == 6, ref[-3000:]
    port = free_port()
    # The rendezvous store lives here, not in one of the agents: an agent that hosts it
    # exits when its own workers are done, and the other agent, still polling the store,
    # then fails with RendezvousConnectionError although every worker succeeded (a torch
    # elastic teardown race, e.g. pytorch/torchtune#2676; it failed this test once).
    store = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,
                     wait_for_workers=False)
    launch = ("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", "is_host=false",
              "--rdzv-id", f"fz3-test-{port}", "--max-restarts", "0")
    nodes = [_torchrun(*launch) for _ in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in nodes]
    del store
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-2000:] for o in outs)
    printed = [o for o in outs if _losses(o)]
    assert len(printed) == 1, outs  # only global rank 0 prints
    assert _losses(printed[0]) == _losses(ref), (printed[0][-1500:], ref[-1500:])
