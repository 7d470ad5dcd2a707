"""``fz3/hf/compat.py``: the supported transformers range, refused at ``fz3.shard`` time before
any collective, and the mask builders' calls that adapt to each release's argument names (and
refuse, naming the release and the range, when nothing fits). In the test process: no ranks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import fz3
from fz3.hf import compat
from fz3.hf.adapters import adapter_for

NEEDS = ("config", "embeds", "attention_mask")


@pytest.mark.parametrize("version", ["5.0.0", "5.17.0", "5.24.0", "5.99.1", "5.25.0.dev0"])
def test_supported_versions(version):
    compat.check_version(version)


@pytest.mark.parametrize("version", ["4.57.6", "6.0.0", "6.0.0.dev0", "4.0", "main"])
def test_unsupported_versions_name_the_version_and_the_range(version):
    says = rf"support transformers>=5\.0,<6; transformers {re.escape(version)} is installed"
    with pytest.raises(ImportError, match=says + r".*pass layers=, pre= and post="):
        compat.check_version(version)


def test_range_is_the_one_pyproject_declares():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    hf = meta["optional-dependencies"]["hf"]
    assert [d for d in hf if d.startswith("transformers")] == [f"transformers{compat.RANGE}"]
    assert f"transformers{compat.RANGE}" in meta["optional-dependencies"]["test"]
    low, high = compat.RANGE.split(",")
    assert low == ">=" + ".".join(map(str, compat.LOWEST)) and high == f"<{compat.BELOW[0]}"


def test_shard_refuses_an_unsupported_release_before_any_collective(monkeypatch):
    """No process group exists here: the version error must come before the process-group
    check (and so before any collective), which a supported release reaches."""
    import transformers

    config = transformers.GPT2Config(vocab_size=11, n_embd=8, n_layer=1, n_head=2)
    module = transformers.GPT2LMHeadModel(config)
    assert not torch.distributed.is_initialized()
    monkeypatch.setattr("transformers.__version__", "5.0.0")  # the module adapter_for imports
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        fz3.shard(module)
    monkeypatch.setattr("transformers.__version__", "4.57.6")
    with pytest.raises(ImportError, match=r"transformers 4\.57\.6 is installed"):
        fz3.shard(module)
    with pytest.raises(ImportError, match=r"transformers 4\.57\.6 is installed"):
        adapter_for(module)


def test_mask_builders_are_called_with_each_release_s_names():
    seen = {}

    def like_5_0(config, input_embeds, attention_mask, cache_position, past_key_values,
                 position_ids=None, or_mask_function=None):
        seen.update(embeds=input_embeds, cache=past_key_values, cache_position=cache_position)

    def like_5_24(config, inputs_embeds, attention_mask, cache, position_ids=None, **kwargs):
        seen.update(embeds=inputs_embeds, cache=cache, kwargs=kwargs)

    values = dict(config="cfg", embeds="e", attention_mask="m", cache=None, cache_position="seq",
                  position_ids="pos")
    compat.call_by_name(like_5_0, values, needs=NEEDS)
    assert seen == dict(embeds="e", cache=None, cache_position="seq")
    seen.clear()
    compat.call_by_name(like_5_24, values, needs=NEEDS)
    assert seen == dict(embeds="e", cache=None, kwargs={})


def test_an_unknown_signature_names_the_release_and_the_range():
    import transformers

    def renamed_required(config, inputs_embeds, attention_mask, kv_store):
        raise AssertionError("must not be called")

    def renamed_optional(config, inputs_embeds, padding_mask=None):  # would drop the mask
        raise AssertionError("must not be called")

    values = dict(config="cfg", embeds="e", attention_mask="m", cache=None)
    release = re.escape(transformers.__version__)
    for fn, says in ((renamed_required, r"\['kv_store'\]"),
                     (renamed_optional, r"takes no \['attention_mask'\]")):
        says = rf"transformers {release}: .*{says}.*transformers>=5\.0,<6"
        with pytest.raises(ImportError, match=says):
            compat.call_by_name(fn, values, needs=NEEDS)


def test_block_output():
    h = torch.ones(1)
    assert compat.block_output(h) is h and compat.block_output((h, "attention weights")) is h


def test_blocks_are_called_with_each_release_s_names():
    """``compat.call_block`` passes each value under a name the block takes: a None it does
    not take is left out (5.0's GPT-J block makes its own rotary tables), a value it does not
    take or an argument it requires and is not given is an ImportError naming the release."""

    class Old(torch.nn.Module):
        def forward(self, hidden_states, attention_mask=None, position_ids=None):
            return hidden_states + 1, None

    class Needs(torch.nn.Module):
        def forward(self, hidden_states, alibi, attention_mask=None):
            return hidden_states + alibi

    h = torch.zeros(1)
    out = compat.call_block(Old(), h, attention_mask=None, position_embeddings=None)
    assert torch.equal(out, h + 1)
    with pytest.raises(ImportError, match=r"Old\.forward.* takes no \['position_embeddings'\]"):
        compat.call_block(Old(), h, position_embeddings=h)
    with pytest.raises(ImportError, match=r"Needs\.forward.* needs \['alibi'\]"):
        compat.call_block(Needs(), h, attention_mask=None)
    assert torch.equal(compat.call_block(Needs(), h, alibi=h + 2), h + 2)
