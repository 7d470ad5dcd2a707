"""Hugging Face models through fz3.shard(model)'s built-in adapters, against the plain HF model.

Models are built from configs with random init (no downloads). Reference: the HF model's
own loss on the concatenated batch, ``loss.backward()``. fp32, rtol 1e-5 / atol 1e-6. Dropout
off at world sizes 1-3, each batch without and with an attention mask (padding on both
sides); at world size 1 also with HF's default dropout, same seed: the forward's masks must be
replayed exactly by the recompute.

CI runs this file on both ends of the supported transformers range (``.ci/hf-range``); it sets
``FZ3_EXPECT_TRANSFORMERS`` and every rank checks it imported that release.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import dist
import fz3
from fz3.hf.adapters import adapter_for
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
        cfg = tf.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=32, attention_dropout=p)
        return tf.LlamaForCausalLM(cfg)
    # the seed's RobertaForMaskedLM architecture, scaled down (30 layers/5120 -> 4 layers/64)
    cfg = tf.RobertaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=4,
                           num_attention_heads=4, intermediate_size=256, max_position_embeddings=64,
                           type_vocab_size=1, hidden_dropout_prob=p, attention_probs_dropout_prob=p)
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


def padded_batch(family: str, rank: int, vocab: int) -> dict:
    """Row 0 padded on the right (3 tokens), row 1 on the left (2), the same on every rank so
    every rank has the same number of labelled tokens; padding is id 1 (RoBERTa's padding_idx)
    with label -100 and attention_mask 0."""
    g = torch.Generator().manual_seed(200 + rank)
    ids = torch.randint(3, vocab, (PER_RANK, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    mask[1, :2] = 0
    ids = ids.masked_fill(mask == 0, 1)
    if family != "roberta":
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
    labels = torch.full_like(ids, -100)
    where = torch.tensor([3, 5, 7])  # tokens of both rows
    labels[:, where] = ids[:, where]
    ids[:, where] = 4  # a <mask> stand-in
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def expected_version() -> str:
    import transformers

    return os.environ.get("FZ3_EXPECT_TRANSFORMERS") or transformers.__version__


def hf_ranks(rank, world, families, dropout, masks=(False, True)):
    import transformers

    found = (transformers.__version__, transformers.__file__)
    assert found[0] == expected_version(), found
    for family in families:
        for masked in masks:
            check_grads(rank, world, family, dropout, masked)
        check_round_trip(family)
    return f"ok {transformers.__version__}"


def hf_reference_grads(module, bs: list[dict], base=lambda m: m, seed: int = 11):
    """Plain autograd on a copy of ``module``: ``base(copy)``'s loss on every rank's batch
    concatenated, after ``torch.manual_seed(seed)`` (the seed the fz3 runs then take, so dropout
    draws the same masks), backward. Returns the detached loss and the gradients by name (tied
    names too), only of parameters the loss reached; the RNG state is as backward left it."""
    ref = copy.deepcopy(module)
    torch.manual_seed(seed)
    loss = base(ref)(**{k: torch.cat([b[k] for b in bs]) for k in bs[0]}).loss
    loss.backward()
    named = ref.named_parameters(remove_duplicate=False)
    return loss.detach(), {n: p.grad for n, p in named if p.grad is not None}


def check_grads(rank, world, family, dropout, masked):
    module = build(family, dropout).train()
    vocab = module.config.vocab_size
    bs = [(padded_batch if masked else batch)(family, r, vocab) for r in range(world)]
    ref_loss, want = hf_reference_grads(module, bs)
    after_ref = torch.get_rng_state()
    adapter_for(module).check_batch(bs[rank])  # the check takes the batches it must take
    model, params = fz3.shard(module)
    for policy in (fz3.Policy(), fz3.Policy(activations="save", layers_per_unit=2)):
        torch.manual_seed(11)
        loss, grads = fz3.value_and_grad(model, policy)(params, bs[rank])
        if dropout:
            assert torch.equal(torch.get_rng_state(), after_ref)
        what = f"{family} {policy} world={world} attention_mask={masked}"
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0, msg=what)
        got = fz3.full_state_dict(model, grads)
        if rank == 0:
            assert_close({n: got[n] for n in want}, want, what=what)
            unused = set(got) - set(want)  # parameters the loss does not reach have zero gradient
            assert all(not got[n].any() for n in unused), unused


def check_round_trip(family):
    """fz3 params, changed, -> module_state_dict -> a fresh HF model: 2 x params is exact in fp32
    (and keeps the padding zero), so the loaded model must hold exactly 2 x the initial weights,
    and its buffers unchanged (the initial weights would fail)."""
    module = build(family, False)
    initial = {n: t.clone() for n, t in module.state_dict().items()}
    param_names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    model, params = fz3.shard(module)
    sd = fz3.module_state_dict(model, fz3.Params(tuple(2 * t for t in params.parts)))
    if sd is None:  # not rank 0
        return
    fresh = build(family, False)
    fresh.load_state_dict(sd, strict=True)
    for name, value in fresh.state_dict().items():
        want = 2 * initial[name] if name in param_names else initial[name]
        assert torch.equal(value, want), f"{family} {name} after the state-dict round trip"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_hf_models_dropout_off(world):
    want = [f"ok {expected_version()}"] * world
    assert dist.run(world, hf_ranks, ("gpt2", "llama", "roberta"), False) == want


def test_hf_models_dropout_on_world1():
    want = [f"ok {expected_version()}"]
    assert dist.run(1, hf_ranks, ("gpt2", "roberta"), True, (False,)) == want


def logits_ranks(rank, world):
    """``fz3.apply(model.eval(), params, batch, output="logits")``: this rank's logits, bitwise
    the model's own (fp32, eval), with a padded row for the decoders; no labels needed."""
    for family in ("gpt2", "llama", "roberta"):
        module = build(family, dropout=False).eval()
        model, params = fz3.shard(module)
        b = batch(family, rank, module.config.vocab_size)
        if family != "roberta":
            mask = torch.ones_like(b["input_ids"])
            mask[0, :3] = 0  # left padding on one row
            b["attention_mask"] = mask
        inputs = {k: v for k, v in b.items() if k != "labels"}
        got = fz3.apply(model.eval(), params, inputs, output="logits")
        with torch.no_grad():
            want = module(**inputs).logits
        assert got.shape == want.shape and got.dtype == torch.float32, (family, got.shape)
        assert torch.equal(got, want), (family, (got - want).abs().max())
    with pytest.raises(ValueError, match=r"takes no loss= or has_aux="):
        fz3.apply(model, params, inputs, output="logits", has_aux=True)
    with pytest.raises(ValueError, match=r"outputs \['logits'\]"):
        fz3.apply(model, params, inputs, output="hidden")
    return "ok"


def test_apply_returns_the_models_own_logits():
    assert dist.run(2, logits_ranks, timeout=300) == ["ok"] * 2
