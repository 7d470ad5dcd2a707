"""Bad fine-tuning input fails at fz3.shard, before any collective, naming the value and the fix:
a PEFT model around an architecture without a built-in adapter, a frozen parameter used both by
a layer and by the parts around the stack."""

from __future__ import annotations

import pytest
import torch

import dist
import fz3
from fz3.models.gpt import GPT, GPTConfig, post, pre

CFG = GPTConfig(vocab=31, seq=8, dim=16, heads=2, layers=2)


def peft_without_adapter_ranks(rank, world):
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    cfg = tf.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    # BertModel: a listed model_type (bert) without the head its adapter is for (ForMaskedLM)
    module = get_peft_model(tf.BertModel(cfg), LoraConfig(r=2, target_modules=["query"]))
    with pytest.raises(
        TypeError,
        match=r"a PEFT model \(PeftModel\) around BertModel, which has no "
        r"built-in adapter .*layers='base_model\.model\.<dotted path of the nn\.ModuleList "
        r"inside BertModel>'.*m\.get_base_model\(\)",
    ):
        fz3.shard(module)
    # what the message says to pass works
    model, _ = fz3.shard(
        module,
        "base_model.model.encoder.layer",
        pre=lambda m, b: m.get_base_model().embeddings(b),
        post=lambda m, h, b: h.sum(),
    )
    assert "base_model.model.encoder.layer" in [p.name for p in model.parts]
    return "ok"


def test_peft_model_without_adapter_says_what_to_pass():
    assert dist.run(1, peft_without_adapter_ranks) == ["ok"]


def frozen_cross_ranks(rank, world):
    torch.manual_seed(0)
    cross = GPT(CFG)
    cross.alias = cross.blocks[0].fc  # a layer's frozen weight now also lives outside the stack
    cross.blocks[0].fc.weight.requires_grad_(False)
    with pytest.raises(
        ValueError,
        match=r"parameter \('blocks.0.fc.weight', 'alias.weight'\) is used both "
        r"inside 'blocks' and outside it; .*untie it or move it",
    ):
        fz3.shard(cross, "blocks", pre, post)
    return "ok"


def test_frozen_parameter_in_a_layer_and_outside_is_named():
    assert dist.run(1, frozen_cross_ranks) == ["ok"]
