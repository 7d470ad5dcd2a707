"""The examples and benchmark scripts run end to end (small settings), so they cannot rot."""

from __future__ import annotations

import json
import os
import re

from dist import run_script


def test_train_gpt_trains_saves_and_resumes(tmp_path):
    ckpt = str(tmp_path / "gpt")
    out = run_script("examples/train_gpt.py", "--steps", "20", "--log-every", "10", "--save-every", "10",
                     "--ckpt", ckpt)
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 1.0, out  # the loss falls
    # the first step (it traces the layers) timed apart; the rate after it, steady
    assert re.search(r"step     1  loss \d+\.\d+  first step \d+\.\d+ s \(traces the layers; not in "
                     r"the rate\)", out), out
    assert re.search(r"step    10  loss \d+\.\d+ +\d+ tokens/s", out), out
    out = run_script("examples/train_gpt.py", "--steps", "22", "--log-every", "2", "--resume", "--ckpt", ckpt)
    assert "resumed from" in out and "step    22" in out, out


def test_compare_quick_fz3_only():
    out = run_script("benchmarks/compare.py", "--quick", "--steps", "2", "--systems", "fz3 save",
                     "--warmup", "1")
    assert re.search(r"\| fz3 save \| \d+\.\d+ \| \d+\.\d+ \| \d+\.\d+ \|", out), out  # step, fwd+bwd, optimizer


def test_host_overhead_proxy_runs():
    """With ``--loop``: each system's optimizer runs between the timed calls (fz3's donated
    step hands the next call new parameter tensors), the path without it is the same less
    that call."""
    out = run_script("benchmarks/host_overhead.py", "--repeats", "1", "--steps", "2", "--systems",
                     "plain eager,fz3 save", "--loop")
    assert re.search(r"\| fz3 save \| -?\d+ \| -?\d+\.\d+ \| \d+\.\d+ \|", out), out
    assert "in a training loop (optimizer untimed)" in out, out


def test_gpu_check_memory_part_dry_run_on_cpu():
    out = run_script("benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--part", "memory")
    assert "| tiny | fz3 recompute |" in out and "memory plan recompute: predicted" in out, out


def test_gpu_check_safety_part_skips_on_cpu(tmp_path):
    """The safety part needs CUDA: on CPU it must take its skip branch (exit 0, the reason in
    gpu_check_safety.json), not run half of the GPU tier or crash."""
    out = run_script("benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--part", "safety",
                     "--out", str(tmp_path))
    assert '"gpu": "cpu"' in out, out
    with open(tmp_path / "gpu_check_safety.json") as f:
        result = json.load(f)
    assert result["safety"] == {"skipped": "the GPU tier needs a GPU"}, result
    assert result["env"]["gpu"] == "cpu", result


def test_gpu_check_dry_run_on_cpu():
    out = run_script("benchmarks/gpu_check.py", "--device", "cpu", "--quick")
    assert "correctness:" in out and "FAIL" not in out and "| fz3 | recompute |" in out, out


def test_finetune_lora_from_disk_saves_the_adapter(tmp_path):
    base, out = str(tmp_path / "base"), str(tmp_path / "lora")
    args = ["--steps", "8", "--log-every", "4", "--dim", "64", "--layers", "2"]
    args += ["--base", base, "--out", out]
    printed = run_script("examples/finetune_lora.py", *args)
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", printed)]
    # steps 1, 4, 8: the loss falls (by ~0.3 here; without training it moves by ~0.01)
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.1, printed
    assert "wrote a random-weight checkpoint" in printed, printed
    assert "trained (LoRA r=8)" in printed, printed
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(out)), printed


def test_gpu_check_lora_dry_run_on_cpu():
    out = run_script("benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--part", "lora")
    rows = re.findall(r"\| (fz3 recompute|fz3 save|FSDP2) \| \d+ \| [\d.]+ \| (\d+\.\d+) \|", out)
    assert [r[0] for r in rows] == ["fz3 recompute", "fz3 save", "FSDP2"], out
    assert len({r[1] for r in rows}) == 1, out  # the same loss: the same model, LoRA and batches
