"""``Adapter.check_batch`` of each Hugging Face adapter, in the test process (pure, local: no
ranks, no collectives): good batches pass, and each kind of bad batch raises with a message
that names what is wrong and what the adapter expects."""

from __future__ import annotations

import collections
import functools
import re

import pytest
import torch

from fz3.hf.adapters import adapter_for

LONG = torch.long
# one model of each head kind, as adapter_for sees it: (class name, config class, auto class)
MODELS = {"GPT2LMHeadModel": ("GPT2Config", "AutoModelForCausalLM"),
          "LlamaForCausalLM": ("LlamaConfig", "AutoModelForCausalLM"),
          "RobertaForMaskedLM": ("RobertaConfig", "AutoModelForMaskedLM")}


@functools.cache
def _check(name: str):
    """The ``check_batch`` of ``name``'s built-in adapter, from a tiny model."""
    import transformers as tf

    config, auto = MODELS[name]
    small = dict(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                 num_attention_heads=2, n_embd=8, n_layer=1, n_head=2)
    module = getattr(tf, auto).from_config(getattr(tf, config)(**small))
    assert type(module).__name__ == name
    return adapter_for(module).check_batch


def good() -> dict:
    ids = torch.randint(0, 10, (2, 5))
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(2, 5, dtype=LONG)}


def with_(**changes) -> dict:
    """``good()`` with keys replaced, added, or (value None) removed."""
    b = good()
    b.update(changes)
    return {k: v for k, v in b.items() if v is not None}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_good_batches_pass(name):
    check = _check(name)
    check(good())
    check(with_(attention_mask=None))
    check(with_(attention_mask=torch.ones(2, 5, dtype=torch.bool)))
    check(with_(attention_mask=torch.ones(2, 5, dtype=torch.int32)))
    check(collections.UserDict(good()))  # transformers' BatchEncoding is a UserDict


BAD = [  # (batch, error type, what the message must say)
    (tuple(good().values()), TypeError, r"got a tuple\. Name the fields"),
    ([good()], TypeError, r"got a list"),
    (with_(labels=None), ValueError, r"the batch has no \['labels'\]"),
    (with_(input_ids=None), ValueError, r"the batch has no \['input_ids'\]"),
    (with_(token_type_ids=torch.zeros(2, 5, dtype=LONG)), ValueError,
     r"also has \['token_type_ids'\], which the adapter would ignore"),
    (with_(labels=[[1, 2, 3, 4, 5]] * 2), TypeError,
     r"batch\['labels'\] is a list: make it a torch\.Tensor"),
    (with_(input_ids=torch.zeros(2, 5)), TypeError,
     r"batch\['input_ids'\] is torch\.float32: convert it with \.long\(\)"),
    (with_(labels=torch.zeros(2, 5, dtype=torch.int32)), TypeError,
     r"batch\['labels'\] is torch\.int32"),
    (with_(attention_mask=torch.ones(2, 5)), TypeError,
     r"batch\['attention_mask'\] is torch\.float32: pass the 0/1 padding mask"),
    (with_(input_ids=torch.zeros(5, dtype=LONG), labels=torch.zeros(5, dtype=LONG),
           attention_mask=None), ValueError,
     r"batch\['input_ids'\] has shape \(5,\): it must be \(B, T\)"),
    (with_(input_ids=torch.zeros(0, 5, dtype=LONG), labels=torch.zeros(0, 5, dtype=LONG),
           attention_mask=None), ValueError,
     r"has shape \(0, 5\): it must be \(B, T\) with B, T >= 1"),
    (with_(labels=torch.zeros(2, 4, dtype=LONG)), ValueError,
     r"batch\['labels'\] has shape \(2, 4\) but input_ids has \(2, 5\)"),
    (with_(attention_mask=torch.ones(2, 1, 5, 5, dtype=torch.bool)), ValueError,
     r"batch\['attention_mask'\] has shape \(2, 1, 5, 5\)"),
]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_batches_raise_with_what_the_adapter_expects(name, case):
    batch, error, says = BAD[case]
    with pytest.raises(error) as info:
        _check(name)(batch)
    message = str(info.value)
    assert re.search(says, message), message
    assert f"fz3's {name} adapter takes a dict with input_ids (B, T)" in message
