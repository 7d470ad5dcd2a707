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

import pytest
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
    merged_loads_as_trained(rank, folder, model, params, loaded)
    return "ok"


def merged_loads_as_trained(rank, folder, model, params, trained_peft):
    """fz3.export of the PEFT model: a plain Llama folder, LoRA merged under the base names,
    that from_pretrained loads with no missing or unexpected keys and the trained logits (it
    wrote PEFT's names: 39 missing, 95 unexpected keys, a random model). fp32: rtol 1e-5 (the
    merge sums W + s*B@A where the PEFT model computes Wx + s*B(Ax): other rounding). bf16:
    the bf16 PEFT model's logits within atol 3e-2, four bf16 steps at the logits' scale
    (|logit| < 1.4, a step 2^-7): each merged weight is rounded to bf16 once more than the
    PEFT model's (measured 0.016; the bf16 PEFT model is itself 0.013 from its fp32 self),
    while the adapter moves the logits by 1.38 (a missing merge fails)."""
    import transformers as tf

    out = os.path.join(folder, "merged")
    fz3.export(out, model, params)
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    if rank == 0:
        back, info = tf.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert type(back).__name__ == "LlamaForCausalLM"
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        with torch.no_grad():
            want = trained_peft.eval()(input_ids=ids).logits
            torch.testing.assert_close(back.eval()(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)
    # bf16, LoRA on the embedding and the head too, B not zero (init_lora_weights=False)
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(6)
    peft16 = get_peft_model(build("llama", False).eval(), LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS + ["embed_tokens", "lm_head"],
        init_lora_weights=False)).to(torch.bfloat16)
    model16, params16 = fz3.shard(peft16)
    out16 = os.path.join(folder, "merged16")
    fz3.export(out16, model16, params16)
    if rank == 0:
        back, info = tf.AutoModelForCausalLM.from_pretrained(out16, output_loading_info=True,
                                                             dtype=torch.bfloat16)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert back.dtype == torch.bfloat16
        with torch.no_grad():
            want = peft16(input_ids=ids).logits.float()
            got = back.eval()(input_ids=ids).logits.float()
            base = peft16.get_base_model()
            with peft16.disable_adapter():
                unmerged = base(input_ids=ids).logits.float()
        assert (unmerged - want).abs().max() > 0.5  # the adapter matters
        torch.testing.assert_close(got, want, rtol=0, atol=3e-2)
        cannot_merge()


def cannot_merge():
    """DoRA, two adapters, modules_to_save: fz3.export's merge refuses each, naming it, before
    any collective (it is built from the model's skeleton on every rank). Run on one rank
    (local, no collective): the ranks have PEFT imported already."""
    from peft import LoraConfig, get_peft_model

    from fz3.hf.peft_merge import merge_for

    dora = get_peft_model(build("llama", False), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj uses DoRA \(use_dora=True\).*fz3.hf.export_peft"):
        merge_for(dora)
    two = get_peft_model(build("llama", False), LoraConfig(r=2, target_modules=["q_proj"]))
    two.add_adapter("second", LoraConfig(r=2, target_modules=["v_proj"]))
    with pytest.raises(ValueError, match=r"with 2 adapters \['default', 'second'\]: fz3 merges one"):
        merge_for(two)
    saved = get_peft_model(build("llama", False), LoraConfig(r=2, target_modules=["q_proj"],
                                                             modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match=r"modules_to_save=\['lm_head'\]"):
        merge_for(saved)
    assert merge_for(build("llama", False)) is None


def test_export_peft_loads_in_peft_and_resume_from_pretrained(tmp_path):
    assert dist.run(2, export_ranks, str(tmp_path)) == ["ok"] * 2
