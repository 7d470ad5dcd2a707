"""The trained part alone: ``fz3.hf.export_peft`` writes PEFT's own layout, which
``PeftModel.from_pretrained(base, path)`` loads into the same LoRA weights and outputs; and a
run resumes from ``fz3.save`` of the trained params + optimizer state with the frozen weights
re-sharded from the pretrained checkpoint (a PEFT model built on meta, ``weights=``).

World size 2, fp32. The loaded PEFT model's LoRA tensors are compared bitwise with fz3's
(export copies them), its loss on each rank's batch with fz3's per-rank loss (rtol 1e-5: the
same math, in the HF forward instead of fz3's units). The resumed run continues bitwise: the
same shards, the same next loss.
"""

from __future__ import annotations

import os

import torch

import dist
import fz3
from reference import assert_rank_mean
from test_hf import batch, build
from test_hf_pretrained import on_meta

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


def peft_model(meta: bool):
    from peft import LoraConfig, get_peft_model

    base = build("llama", False).eval()
    if meta:
        base = on_meta(base)
    torch.manual_seed(5)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    return fz3.hf.init_lora(peft) if meta else peft


def export_ranks(rank, world, folder):
    from peft import PeftModel

    pretrained, adapter, ckpt = (os.path.join(folder, k) for k in ("base", "adapter", "ckpt"))
    if rank == 0:
        build("llama", False).save_pretrained(pretrained)
    module = peft_model(meta=False)
    model, params = fz3.shard(module)
    opt = fz3.optim.adamw(lr=1e-2)
    state = opt.init(params)
    b = batch("llama", rank, module.get_base_model().config.vocab_size)
    for _ in range(2):
        _, grads = fz3.value_and_grad(model)(params, b)
        params, state = fz3.optim.step(opt, grads, state, params)
    files = fz3.hf.export_peft(adapter, model, params)
    fz3.save(ckpt, model, {"params": params, "opt": state})
    trained = fz3.full_state_dict(model, params)
    assert (rank == 0) == ("adapter_model.safetensors" in files and "adapter_config.json" in files)
    torch.distributed.barrier()
    loaded = PeftModel.from_pretrained(build("llama", False).eval(), adapter)
    with torch.no_grad():
        want = float(loaded.get_base_model()(**b).loss)
    assert_rank_mean(fz3.apply(model.eval(), params, b), want)
    if rank == 0:
        lora = {n: p for n, p in loaded.named_parameters() if ".lora_" in n}
        assert set(lora) == set(trained), set(lora) ^ set(trained)
        assert all(torch.equal(lora[n], trained[n]) for n in lora)
    # resume: frozen weights from the pretrained checkpoint, trained ones and AdamW from fz3.save
    model2, fresh = fz3.shard(peft_model(meta=True), weights=pretrained)
    restored = fz3.load(ckpt, model2, {"params": fresh, "opt": opt.init(fresh)})
    assert all(torch.equal(a, b) for a, b in zip(restored["params"].parts, params.parts))
    assert all(
        (a is None and b is None) or torch.equal(a, b) for a, b in zip(model2.frozen, model.frozen)
    )
    next_loss, _ = fz3.value_and_grad(model)(params, b)
    resumed_loss, _ = fz3.value_and_grad(model2)(restored["params"], b)
    assert torch.equal(next_loss, resumed_loss)
    return "ok"


def test_export_peft_loads_in_peft_and_resume_from_pretrained(tmp_path):
    assert dist.run(2, export_ranks, str(tmp_path)) == ["ok"] * 2
