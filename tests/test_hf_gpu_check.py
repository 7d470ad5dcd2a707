"""``benchmarks/gpu_check.py --part hf`` on CPU: the GPU check's Hugging Face Llama step runs
through ``fz3.shard(model)`` with the installed transformers and reports that release (under
``.ci/hf-range``, the bottom of the range)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from test_hf import expected_version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_hf_llama_step_reports_its_transformers():
    with socket.socket() as s:  # a free port for this run's rendezvous
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", MASTER_PORT=port)
    args = ["benchmarks/gpu_check.py", "--device", "cpu", "--part", "hf"]
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"transformers {expected_version()}: HF Llama step ok, loss " in p.stdout, p.stdout
