"""``fz3.shard(meta_module, weights=folder)``: shards filled from a Hugging Face checkpoint on
disk, each rank reading only the slices it owns.

The checkpoints are random-initialised models saved with ``save_pretrained`` (one file, and a
sharded index). At world size 3 (uneven shards): every weight and buffer equals the saved
model's bitwise (``full_state_dict`` and the skeleton's buffers: rotary ``inv_freq``, RoBERTa's
``position_ids`` computed by the model's own init, GPT-2's head read under the tied embedding's
name); each rank read about its share of the bytes (``Pretrained.bytes_read``: its shard plus at
most two rows per parameter its range cuts), and no single read was larger than that; fz3's own
allocations while sharding (``LiveBytes``) stay under the rank's shards plus one tensor. A PEFT
LoRA model built on meta (``fz3.hf.init_lora``) from the base checkpoint gives the base model's
loss (PEFT's init makes ``lora_B`` zero).
"""

from __future__ import annotations

import os

import pytest
import torch

import dist
import fz3
from fz3.observe.live_bytes import LiveBytes
from reference import assert_rank_mean
from test_hf import batch, build


def saved(family: str, folder: str, shard_size: str | None) -> torch.nn.Module:
    module = build(family, False).eval()
    module.save_pretrained(folder, **({"max_shard_size": shard_size} if shard_size else {}))
    return module


def on_meta(module: torch.nn.Module) -> torch.nn.Module:
    with torch.device("meta"):
        meta = type(module)(module.config)
    meta.tie_weights()  # as from_pretrained does (transformers 5.0 does not tie on meta by itself)
    return meta


def pretrained_ranks(rank, world, folder, families):
    for family in families:
        for shard_size in (None, "20KB"):
            where = os.path.join(folder, f"{family}-{shard_size}")
            if rank == 0:
                saved(family, where, shard_size)
            torch.distributed.barrier()
            check_family(rank, world, family, where, shard_size)
    check_peft(rank, world, folder)
    return "ok"


def check_family(rank, world, family, where, shard_size):
    real = build(family, False).eval()  # the same seed: the saved model's values
    assert os.path.exists(os.path.join(where, "model.safetensors.index.json")) == bool(shard_size)
    source = fz3.Pretrained(where)
    meta = on_meta(real)
    with LiveBytes() as live:
        model, params = fz3.shard(meta, weights=source)
    mine = sum(t.numel() * t.element_size() for t in params.parts)
    biggest = max(p.numel() * p.element_size() for p in real.parameters())
    assert live.peak <= mine + biggest, (family, live.peak, mine, biggest)
    slack = sum(2 * _row_bytes(s) for part in model.parts for s in part.layout.slots) * max(
        p.rows for p in model.parts
    )
    assert source.bytes_read <= mine + slack, (family, source.bytes_read, mine, slack)
    whole = sum(p.numel() * p.element_size() for p in real.parameters())
    assert source.bytes_read < 0.6 * whole, (family, source.bytes_read, whole)
    sd = fz3.module_state_dict(model, params)
    buffers = dict(model.skeleton.named_buffers())
    for name, b in real.named_buffers():
        assert torch.equal(buffers[name], b), f"{family} buffer {name}"
    if rank == 0:
        want = real.state_dict()
        assert set(sd) == set(want), set(sd) ^ set(want)
        for name, t in want.items():
            assert torch.equal(sd[name], t), f"{family} {name} (index={bool(shard_size)})"


def _row_bytes(slot) -> int:
    return (slot.numel // slot.shape[0] if slot.shape else 1) * 4


def check_peft(rank, world, folder):
    from peft import LoraConfig, get_peft_model

    where = os.path.join(folder, "llama-None")
    base = build("llama", False).eval()
    b = batch("llama", rank, base.config.vocab_size)
    want = float(base(**b).loss)
    cfg = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"])
    peft = fz3.hf.init_lora(get_peft_model(on_meta(base), cfg))
    model, params = fz3.shard(peft, weights=where)
    loss = fz3.apply(model.eval(), params, b)
    assert_rank_mean(loss, want)
    sd = fz3.module_state_dict(model, params)
    if rank == 0:
        named = dict(base.named_parameters())
        q = "base_model.model.model.layers.1.self_attn.q_proj"
        assert torch.equal(
            sd[f"{q}.base_layer.weight"], named["model.layers.1.self_attn.q_proj.weight"]
        )
        assert not sd[f"{q}.lora_B.default.weight"].any() and sd[f"{q}.lora_A.default.weight"].any()


def test_shard_from_checkpoint_reads_only_this_ranks_slices(tmp_path):
    assert dist.run(3, pretrained_ranks, str(tmp_path), ("gpt2", "llama", "roberta")) == ["ok"] * 3


def errors_ranks(rank, world, folder):
    real = saved("llama", folder, None)
    with pytest.raises(
        FileNotFoundError,
        match=r"weights='/nonexistent' has no model.safetensors nor "
        r"model.safetensors.index.json",
    ):
        fz3.shard(on_meta(real), weights="/nonexistent")
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(on_meta(real), LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(
        ValueError,
        match=r"parameter base_model.model.model.layers.0.self_attn.q_proj.lora_A"
        r".default.weight is on the meta device and checkpoint .* has no .*fz3.hf.init_lora",
    ):
        fz3.shard(peft, weights=folder)
    with pytest.raises(
        ValueError,
        match=r"parameter model.embed_tokens.weight is on the meta device; .*or pass "
        r"weights=",
    ):
        fz3.shard(on_meta(real))
    return "ok"


def test_pretrained_errors_name_the_fix(tmp_path):
    assert dist.run(1, errors_ranks, str(tmp_path)) == ["ok"]
