"""Hugging Face models through fz3.shard(model)'s built-in adapters, against the plain HF model.

Models are built from configs with random init (no downloads). Reference: the HF model's
own loss on the concatenated batch, ``loss.backward()``. fp32, rtol 1e-5 / atol 1e-6. Dropout
off at world sizes 1-3; at world size 1 also with HF's default dropout, same seed: the
forward's masks must be replayed exactly by the recompute.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dist
import fz3
from reference import assert_close


SEQ, PER_RANK = 12, 2


def build(family: str, dropout: bool):
    import transformers as tf

    p = 0.1 if dropout else 0.0
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=3, n_head=4,
                            resid_pdrop=p, embd_pdrop=p, attn_pdrop=p)
        return tf.GPT2LMHeadModel(cfg)
    if family == "llama":
        cfg = tf.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                             attention_dropout=p)
        return tf.LlamaForCausalLM(cfg)
    # the seed's RobertaForMaskedLM architecture, scaled down (30 layers/5120 -> 4 layers/64)
    cfg = tf.RobertaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                           intermediate_size=256, max_position_embeddings=64, type_vocab_size=1,
                           hidden_dropout_prob=p, attention_probs_dropout_prob=p)
    return tf.RobertaForMaskedLM(cfg)


def batch(family: str, rank: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, vocab, (PER_RANK, SEQ), generator=g)
    if family != "roberta":
        return {"input_ids": ids, "labels": ids.clone()}
    labels = torch.full_like(ids, -100)
    for row in range(PER_RANK):  # the same number of masked tokens on every rank (see fz3.hf)
        where = torch.randperm(SEQ, generator=g)[:3]
        labels[row, where] = ids[row, where]
        ids[row, where] = 4  # a <mask> stand-in
    return {"input_ids": ids, "labels": labels}


def hf_ranks(rank, world, families, dropout):
    for family in families:
        module = build(family, dropout).train()
        vocab = module.config.vocab_size
        bs = [batch(family, r, vocab) for r in range(world)]
        ref = copy.deepcopy(module)
        torch.manual_seed(11)
        ref_loss = ref(input_ids=torch.cat([b["input_ids"] for b in bs]),
                       labels=torch.cat([b["labels"] for b in bs])).loss
        ref_loss.backward()
        after_ref = torch.get_rng_state()
        want = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False) if p.grad is not None}
        model, params = fz3.shard(module)
        for policy in (fz3.Policy(), fz3.Policy(activations="save", layers_per_unit=2)):
            torch.manual_seed(11)
            loss, grads = fz3.value_and_grad(model, policy)(params, bs[rank])
            if dropout:
                assert torch.equal(torch.get_rng_state(), after_ref)
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0, msg=f"{family} loss")
            got = fz3.full_state_dict(model, grads, buffers=False)
            if rank == 0:
                assert_close({n: got[n] for n in want}, want, what=f"{family} {policy} world={world}")
                unused = set(got) - set(want)  # parameters the loss does not reach have zero gradient
                assert all(not got[n].any() for n in unused), unused
        sd = fz3.full_state_dict(model, params)
        if rank == 0:
            fresh = build(family, dropout)
            fresh.load_state_dict(sd, strict=True)
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_hf_models_dropout_off(world):
    assert dist.run(world, hf_ranks, ("gpt2", "llama", "roberta"), False) == ["ok"] * world


def test_hf_models_dropout_on_world1():
    assert dist.run(1, hf_ranks, ("gpt2", "roberta"), True) == ["ok"]
