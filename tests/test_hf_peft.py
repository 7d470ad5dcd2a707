"""LoRA through PEFT: ``fz3.shard(get_peft_model(hf_model, LoraConfig(...)))`` against plain
autograd on the unsharded PEFT model.

LoRA on attention and MLP projections of GPT-2 (``Conv1D``), Llama and RoBERTa (whose
``dense`` target also hits the MLM head's, in ``post``), with ``init_lora_weights=False`` so
``lora_B`` is not zero (with PEFT's default zero ``lora_B``, ``lora_A``'s gradient is zero and
would prove nothing). fp32, rtol 1e-5 / atol 1e-6: loss and the LoRA gradients at world sizes
1-3 with dropout off; at world size 1 also with dropout on (HF's and LoRA's), the same seed
before both, as ``test_hf.py`` does. After optimizer steps the frozen weights are bitwise the
pretrained ones. CI runs this file on both ends of the transformers range (``.ci/hf-range``).
"""

from __future__ import annotations

import pytest
import torch

import dist
import fz3
from reference import assert_close
from test_hf import batch, build, expected_version, hf_reference_grads

TARGETS = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],  # attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "roberta": ["query", "value", "dense"],  # attention, MLP and the head's dense (post)
}


def lora(family: str, dropout: bool):
    from peft import LoraConfig, get_peft_model

    module = build(family, dropout)
    torch.manual_seed(1)
    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=TARGETS[family],
        init_lora_weights=False,
        lora_dropout=0.1 if dropout else 0.0,
    )
    return get_peft_model(module, cfg).train()


def peft_ranks(rank, world, families, dropout):
    import transformers

    assert transformers.__version__ == expected_version(), transformers.__file__
    for family in families:
        check_lora(rank, world, family, dropout)
    return f"ok {transformers.__version__}"


def check_lora(rank, world, family, dropout):
    module = lora(family, dropout)
    vocab = module.get_base_model().config.vocab_size
    bs = [batch(family, r, vocab) for r in range(world)]
    ref_loss, want = hf_reference_grads(module, bs, base=lambda m: m.get_base_model())
    assert want and all(".lora_" in n for n in want)
    pretrained = {
        n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad
    }
    model, params = fz3.shard(module)
    opt = fz3.optim.adamw(lr=1e-2)
    state = opt.init(params)
    # selective recompute on frozen weights and LoRA's (one family at one world size: its
    # traces cost)
    selective = (fz3.Policy(activations="selective"),) if (world, family) == (2, "llama") else ()
    for policy in (fz3.Policy(), fz3.Policy(activations="save", layers_per_unit=2), *selective):
        torch.manual_seed(11)
        loss, grads = fz3.value_and_grad(model, policy)(params, bs[rank])
        what = f"LoRA {family} {policy} world={world} dropout={dropout}"
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0, msg=what)
        got = fz3.full_state_dict(model, grads)
        if rank == 0:
            assert_close(got, want, what=what)
    for _ in range(2):
        _, grads = fz3.value_and_grad(model)(params, bs[rank])
        params, state = fz3.optim.step(opt, grads, state, params, donate=True)
    sd = fz3.module_state_dict(model, params)
    if rank == 0:
        for n, p in pretrained.items():
            assert torch.equal(sd[n], p), f"{family}: frozen {n} changed"
        assert any(
            not torch.equal(sd[n], p) for n, p in module.named_parameters() if p.requires_grad
        )


@pytest.mark.parametrize("world", [1, 2, 3])
def test_lora_equals_plain_autograd(world):
    want = [f"ok {expected_version()}"] * world
    assert dist.run(world, peft_ranks, ("gpt2", "llama", "roberta"), False) == want


def test_lora_with_dropout_world1():
    assert dist.run(1, peft_ranks, ("gpt2", "llama"), True) == [f"ok {expected_version()}"]
