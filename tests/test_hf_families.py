"""Hugging Face families out of the box, by ``config.model_type`` (``fz3/hf/decoders.py``,
``causal.py``, ``encoders.py``): ``fz3.shard(AutoModelForCausalLM.from_config(cfg))`` (or
``AutoModelForMaskedLM``) with no ``layers``/``pre``/``post`` for Llama, Mistral (sliding
window), Qwen2 (sliding and full layers), Qwen3, Phi3, OLMo, OLMo2, StableLM, Granite
(multipliers), Gemma, Gemma2 and Gemma3 (alternating layer types, soft-capping, rotary tables
per type), the mixture-of-experts Mixtral, Qwen2-MoE (a dense layer after a sparse one: two
stacks), Qwen3-MoE and OLMoE (without the router's loss, transformers' default; with it, each
rank's batch its own reference), GPT-NeoX,
GPT-J, OPT (a projection in and out), BLOOM (ALiBi), Falcon (the new decoder architecture),
BERT and ModernBERT (global and local layers, a first layer of its own). GPT-2 and RoBERTa:
``tests/test_hf.py``.

Reference: plain autograd on the unsharded HF model, ``model(**batch).loss`` over every
rank's batch concatenated, then backward. fp32, rtol 1e-5 / atol 1e-6 on the loss and every
gradient (measured: equal bit for bit at world size 1). World size 2, the default policy,
traced (only the fallbacks ``FALLS_BACK`` names are allowed), 2 layers of hidden 32 (3 for
ModernBERT), a left-padded row on every rank. A family the installed transformers lacks is
skipped, by name (``.ci/hf-range`` runs this on the lowest supported release). The whole
matrix (every family under ``save``, ``trace=False``, LoRA, ``weights=``, export and logits):
``.ci/hf-zoo``."""

from __future__ import annotations

import warnings

import pytest
import torch

import dist
import fz3
from hf_families import (COMMON, FAMILIES, FINETUNED, MASKED, ROUTER, batch, build,
                         check_traced, finetune_ranks, reference, router_loss_ranks,
                         save_families)
from reference import assert_close
from test_hf import expected_version

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
        ref_loss, want = reference(module, bs)
        model, params = fz3.shard(module)
        # the adapter's example (from the config) places by use exactly as the adapter does
        assert not model.parts.moves, (family, model.parts.moves)
        step = fz3.value_and_grad(model)
        loss, grads = step(params, bs[rank])
        check_traced(family, step.traced.failed)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=family)
        got = fz3.full_state_dict(model, grads)
        if rank == 0:
            assert_close(got, want, what=family)
        done.append(family)
    return done, missing


def test_families_equal_plain_hf():
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


def test_an_unlisted_decoder_is_matched_by_structure_not_by_type():
    """A model type fz3 does not list, built like the template, is matched by what it holds
    (its class and model_type unknown to fz3), verified on a tiny copy and logged once; the
    same model with a head the template does not follow is refused naming its layers."""
    import transformers as tf

    class TinyLlamaLike(tf.LlamaForCausalLM):
        pass

    module = TinyLlamaLike(tf.LlamaConfig(**COMMON))
    module.config.model_type = "my_llama"
    from fz3.hf.adapters import adapter_for

    assert adapter_for(module).layers == "model.layers"

    class TinyLlamaHeadless(tf.LlamaModel):
        pass

    headless = TinyLlamaHeadless(tf.LlamaConfig(**COMMON))
    headless.config.model_type = "my_llama"
    with pytest.raises(TypeError, match=r"no built-in adapter for TinyLlamaHeadless \(model_type "
                                        r"'my_llama' with this head is not one of the tested "
                                        r"families \(bert \(\.\.\.ForMaskedLM\), .*llama "
                                        r"\(\.\.\.ForCausalLM\), .*\), and the decoder template "
                                        r"matched by structure cannot follow it: "
                                        r"TinyLlamaHeadless is not a \.\.\.ForCausalLM.*"
                                        r"layer containers in it: 'layers' "
                                        r"\(ModuleList of 2 x LlamaDecoderLayer, all alike\); "
                                        r"pass layers='layers'.*call_layer=.*assign=.*"
                                        r"'A model without a built-in adapter'"):
        adapter_for(headless)


def test_moe_families_with_the_router_loss_equal_plain_hf():
    """Mixtral, Qwen2-MoE (a sparse and a dense stack), Qwen3-MoE and OLMoE with
    ``output_router_logits=True``: the loss adds the load-balancing loss, from each layer's
    router statistics carried to the loss (``layer_aux``), equal to plain HF's at fp32 rtol
    1e-5 / atol 1e-6 with every gradient; ``fz3.hf.losses`` reports it. The default policy
    (traced in fp32, ``fz3.step.fake_kernels``); ``.ci/hf-zoo`` runs save and
    trace=False."""
    assert dist.run(2, router_loss_ranks, timeout=300) == ["ok"] * 2


def bf16_moe_ranks(rank, world):
    """Mixtral in bf16 (the common training dtype, whose fake grouped matmul kernel exists),
    with its router's load-balancing loss: its layers trace (with their aux outputs), and the
    traced step equals the untraced one bit for bit."""
    model, params = fz3.shard(build("mixtral", ROUTER),
                              precision=fz3.Precision(param_dtype=torch.bfloat16))
    assert model.layer_aux
    b = batch(rank)
    got = []
    for trace in (True, False):
        step = fz3.value_and_grad(model, trace=trace)
        got.append(step(params, b))
        if trace:
            assert step.traced.failed == {}, step.traced.failed
    (loss, grads), (want_loss, want) = got
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(a, w) for a, w in zip(grads.parts, want.parts))
    return "ok"


def test_an_moe_layer_traces_in_bf16_and_equals_untraced():
    if build("mixtral") is None:
        pytest.skip("the installed transformers has no mixtral")
    assert dist.run(2, bf16_moe_ranks, timeout=300) == ["ok"] * 2


def test_families_fine_tune_from_disk_with_lora_and_export(tmp_path):
    families = save_families(tmp_path, FINETUNED)
    assert dist.run(2, finetune_ranks, str(tmp_path), families, timeout=400) == ["ok"] * 2


def test_configs_fz3_cannot_follow_are_refused_by_name():
    """Before any collective (``adapter_for`` is local): an attention implementation whose
    masks the adapters do not build, and each family's setting fz3 does not follow; a listed
    type with another head is a model without an adapter."""
    import transformers as tf

    from fz3.hf.adapters import adapter_for

    llama = tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON))
    llama.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=r"LlamaForCausalLM uses attn_implementation="
                                         r"'flex_attention'; .* eager, sdpa only"):
        adapter_for(llama)
    refused = {
        "opt": (dict(layerdrop=0.1), r"OPT's layerdrop=0\.1 skips random layers"),
        "falcon": (dict(alibi=True), r"Falcon with config\.alibi=True .* pass layers="),
        "mixtral": (dict(output_router_logits=True, router_jitter_noise=0.1),
                    r"config\.router_jitter_noise=0\.1 with output_router_logits=True: .*set "
                    r"config\.router_jitter_noise = 0\.0"),
        "modernbert": (dict(sparse_prediction=True),
                       r"ModernBERT with config\.sparse_prediction=True"),
    }
    for family, (setting, says) in refused.items():
        name, extra = FAMILIES[family]
        auto = tf.AutoModelForMaskedLM if family in MASKED else tf.AutoModelForCausalLM
        with warnings.catch_warnings():  # as in build
            warnings.simplefilter("ignore", DeprecationWarning)
            module = auto.from_config(getattr(tf, name)(**{**COMMON, **extra, **setting}))
        with pytest.raises(ValueError, match=f"built-in adapter for {type(module).__name__}: "
                                             f"{says}"):
            adapter_for(module)
    classifier = tf.BertForSequenceClassification(tf.BertConfig(**COMMON))
    with pytest.raises(TypeError, match=r"no built-in adapter for BertForSequenceClassification"):
        adapter_for(classifier)
