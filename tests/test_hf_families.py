"""Hugging Face decoder families out of the box (``fz3/hf/decoders.py``):
``fz3.shard(AutoModelForCausalLM.from_config(cfg))`` with no ``layers``/``pre``/``post`` for
Mistral (sliding window), Qwen2 (sliding and full layers), Qwen3, Phi3, OLMo, OLMo2, StableLM,
Granite (multipliers), Gemma, Gemma2 and Gemma3 (alternating layer types, soft-capping, rotary
tables per type).

Reference: plain autograd on the unsharded HF model, ``model(**batch).loss`` over every
rank's batch concatenated, then backward. fp32, rtol 1e-5 / atol 1e-6 on the loss and every
gradient (measured: equal bit for bit at world size 1). World size 2, the default policy,
traced (nothing may fall back), 2 layers of hidden 32, a left-padded row on every rank. A
family the installed transformers lacks is skipped, by name (``.ci/hf-range`` runs this on
the lowest supported release)."""

from __future__ import annotations

import copy

import pytest
import torch

import dist
import fz3
from reference import assert_close
from test_hf import expected_version

COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
# model_type -> (config class name, its extra settings): each family's own features switched on
FAMILIES = {
    "mistral": ("MistralConfig", dict(sliding_window=4)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=8)),
    "phi3": ("Phi3Config", {}),
    "olmo": ("OlmoConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "stablelm": ("StableLmConfig", {}),
    "granite": ("GraniteConfig", dict(embedding_multiplier=2.0, logits_scaling=4.0,
                                      residual_multiplier=0.5, attention_multiplier=0.3)),
    "gemma": ("GemmaConfig", dict(head_dim=8)),
    "gemma2": ("Gemma2Config", dict(head_dim=8, sliding_window=4, final_logit_softcapping=5.0,
                                    attn_logit_softcapping=None)),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=8, sliding_window=4,
                                             final_logit_softcapping=5.0,
                                             sliding_window_pattern=2)),
}


def build(family: str):
    import transformers as tf

    name, extra = FAMILIES[family]
    config_class = getattr(tf, name, None)
    if config_class is None:
        return None
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config_class(**COMMON, **extra))


def batch(rank: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, 97, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 0] = -100  # the same number of labelled tokens on every rank
    labels[1, 1] = -100
    labels[1, 2] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def families_ranks(rank, world):
    import transformers

    assert transformers.__version__ == expected_version()
    bs = [batch(r) for r in range(world)]
    done, missing = [], []
    for family in FAMILIES:
        module = build(family)
        if module is None:
            missing.append(family)
            continue
        ref = copy.deepcopy(module)
        ref_loss = ref(**{k: torch.cat([b[k] for b in bs]) for k in bs[0]}).loss
        ref_loss.backward()
        want = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)
                if p.grad is not None}
        model, params = fz3.shard(module)
        step = fz3.value_and_grad(model)
        loss, grads = step(params, bs[rank])
        assert step.traced.failed == {}, (family, step.traced.failed)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6, msg=family)
        got = fz3.full_state_dict(model, grads)
        if rank == 0:
            assert_close(got, want, what=family)
        done.append(family)
    return done, missing


def test_decoder_families_equal_plain_hf():
    got = dist.run(2, families_ranks, timeout=400)
    done, missing = got[0]
    assert got[0] == got[1]
    if missing:  # only on an older transformers than the pinned one
        assert expected_version() != transformers_pinned(), missing
    assert done, "no family ran"


def transformers_pinned() -> str:
    import pathlib

    for line in (pathlib.Path(__file__).parent.parent / "constraints.txt").read_text().splitlines():
        if line.startswith("transformers=="):
            return line.split("==")[1]
    return ""


def test_an_unlisted_decoder_is_refused_by_name():
    """A model type fz3 does not list is refused though it looks like the template."""
    import transformers as tf

    class TinyLlamaLike(tf.LlamaForCausalLM):
        pass

    module = TinyLlamaLike(tf.LlamaConfig(**COMMON))
    module.config.model_type = "my_llama"
    from fz3.hf.adapters import adapter_for

    with pytest.raises(TypeError, match=r"no built-in adapter for TinyLlamaLike .*model_type "
                                        r"gemma, gemma2, .*qwen3, stablelm\); pass layers="):
        adapter_for(module)


FINETUNED = ("qwen2", "gemma2")  # one Llama-like, one Gemma-like (sliding layers, soft-capping)


def finetune_ranks(rank, world, folder):
    """``weights=``: the shards read from ``save_pretrained``'s folder into a meta model equal
    the real model's (bitwise: the same values); PEFT LoRA (``init_lora_weights=False``, so
    ``lora_B`` is not zero) against plain PEFT autograd at 1e-5 / 1e-6."""
    import os

    from peft import LoraConfig, get_peft_model
    from test_hf_pretrained import on_meta

    bs = [batch(r) for r in range(world)]
    for family in FINETUNED:
        real = build(family)
        if real is None:
            continue
        model, params = fz3.shard(real)
        want = fz3.value_and_grad(model)(params, bs[rank])
        meta_model, meta_params = fz3.shard(on_meta(real), weights=os.path.join(folder, family))
        got = fz3.value_and_grad(meta_model)(meta_params, bs[rank])
        assert torch.equal(got[0], want[0]), family
        assert all(torch.equal(a, b) for a, b in zip(got[1].parts, want[1].parts)), family
        torch.manual_seed(1)
        peft = get_peft_model(build(family), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                        target_modules=["q_proj", "v_proj"]))
        ref = copy.deepcopy(peft)
        ref_loss = ref(**{k: torch.cat([b[k] for b in bs]) for k in bs[0]}).loss
        ref_loss.backward()
        expected = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        assert expected and all(".lora_" in n for n in expected), sorted(expected)[:4]
        model, params = fz3.shard(peft)
        loss, grads = fz3.value_and_grad(model)(params, bs[rank])
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6, msg=family)
        lora = fz3.full_state_dict(model, grads)
        if rank == 0:
            assert_close(lora, expected, what=f"LoRA {family}")
    return "ok"


def test_decoder_families_fine_tune_from_disk_and_with_lora(tmp_path):
    for family in FINETUNED:
        module = build(family)
        if module is not None:
            module.save_pretrained(tmp_path / family)
    assert dist.run(2, finetune_ranks, str(tmp_path), timeout=400) == ["ok"] * 2


def _readme_pattern() -> dict:
    """The README's GPT-NeoX block, executed as written."""
    import pathlib

    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    start = text.index("  # GPT-NeoX, a model fz3 has no adapter for")
    block = text[start:text.index("  ```", start)]
    code = "\n".join(line[2:] for line in block.splitlines())
    code = code[:code.index("model, params = fz3.shard(neox")]
    scope = {"torch": torch, "fz3": fz3}
    exec(compile(code, "README.md", "exec"), scope)
    return scope


def readme_pattern_ranks(rank, world):
    import transformers as tf

    scope = _readme_pattern()
    torch.manual_seed(0)
    neox = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, pad_token_id=0))
    bs = [batch(r) for r in range(world)]
    ref = copy.deepcopy(neox)
    ref_loss = ref(**{k: torch.cat([b[k] for b in bs]) for k in bs[0]}).loss
    ref_loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    model, params = fz3.shard(neox, layers="gpt_neox.layers", pre=scope["neox_pre"],
                              post=scope["neox_post"], call_layer=scope["neox_layer"])
    step = fz3.value_and_grad(model)
    loss, grads = step(params, bs[rank])
    assert step.traced.failed == {}, step.traced.failed
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    got = fz3.full_state_dict(model, grads)
    if rank == 0:
        assert_close(got, want, what="GPT-NeoX through the README's pattern")
    return "ok"


def test_the_readme_pattern_for_a_model_without_an_adapter():
    assert dist.run(2, readme_pattern_ranks, timeout=300) == ["ok"] * 2


# T5's encoder: block 0 owns the relative-position bias every block reads. assign= moves it
# out of block 0 into pre, which computes the bias once and passes it to every layer; the
# blocks then stack as one.
T5_BIAS = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias"


def t5_pre(m, batch):
    enc, ids = m.encoder, batch["input_ids"]
    h = enc.embed_tokens(ids)
    mask = fz3.hf.bidirectional_mask(m.config, h, batch.get("attention_mask"))
    attention = enc.block[0].layer[0].SelfAttention
    bias = attention.compute_bias(ids.shape[1], ids.shape[1], device=h.device)
    return enc.dropout(h), mask, bias


def t5_layer(block, h, mask, bias):
    return block(h, mask, bias)[0]


def t5_post(m, h, batch):  # T5EncoderModel has no loss: a regression onto batch["target"]
    out = m.encoder.dropout(m.encoder.final_layer_norm(h))
    return ((out - batch["target"]) ** 2).mean()


def t5_ranks(rank, world):
    import transformers as tf

    torch.manual_seed(0)
    t5 = tf.T5EncoderModel(tf.T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=3,
                                       num_heads=4, dropout_rate=0.0))
    bs = []
    for r in range(world):
        g = torch.Generator().manual_seed(r)
        ids = torch.randint(3, 97, (2, 10), generator=g)
        mask = torch.ones_like(ids)
        mask[0, -3:] = 0  # padding
        bs.append({"input_ids": ids, "attention_mask": mask,
                   "target": torch.randn(2, 10, 32, generator=g)})
    ref = copy.deepcopy(t5)
    whole = {k: torch.cat([b[k] for b in bs]) for k in bs[0]}
    out = ref(input_ids=whole["input_ids"], attention_mask=whole["attention_mask"])
    ref_loss = ((out.last_hidden_state - whole["target"]) ** 2).mean()
    ref_loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)
            if p.grad is not None}
    model, params = fz3.shard(t5, layers="encoder.block", pre=t5_pre, post=t5_post,
                              call_layer=t5_layer, assign={T5_BIAS: "pre"})
    assert [p.rows for p in model.parts if p.role is fz3.Role.STACK] == [3]
    for policy in (fz3.Policy(), fz3.Policy(activations="save")):
        step = fz3.value_and_grad(model, policy)
        loss, grads = step(params, bs[rank])
        assert step.traced.failed == {}, step.traced.failed
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        got = fz3.full_state_dict(model, grads)
        if rank == 0:
            assert_close(got, want, what=f"T5 encoder {policy}")
    return "ok"


def test_t5_encoder_trains_with_its_bias_assigned_to_pre():
    """``T5EncoderModel``: loss and every gradient against plain HF (fp32 rtol 1e-5 / atol
    1e-6), 3 blocks in one stack. Skipped where the installed release folds the padding mask
    into block 0's bias and hands that to the later blocks (5.0: they then add no mask of
    their own, so a bias passed apart to each block leaves the padding unmasked); 5.24 adds
    the mask in every block's attention."""
    import inspect

    import transformers as tf

    if "position_bias = position_bias + causal_mask" in inspect.getsource(
            tf.models.t5.modeling_t5.T5Attention.forward):
        pytest.skip(f"transformers {tf.__version__} folds the mask into block 0's T5 bias")
    assert dist.run(2, t5_ranks, timeout=300) == ["ok"] * 2
