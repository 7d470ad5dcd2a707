"""``benchmarks/gpu_check.py --part hf`` on CPU: the GPU check's Hugging Face Llama step runs
through ``fz3.shard(model)`` with the installed transformers and reports that release (under
``.ci/hf-range``, the bottom of the range)."""

from __future__ import annotations

from dist import run_script
from test_hf import expected_version


def test_hf_llama_step_reports_its_transformers():
    out = run_script("benchmarks/gpu_check.py", "--device", "cpu", "--part", "hf")
    assert f"transformers {expected_version()}: HF Llama step ok, loss " in out, out
