"""The whole Hugging Face matrix, opt-in (``.ci/hf-zoo``; not collected by the README's test
command, whose ``tests/test_hf_families.py`` runs each family once and fine-tunes one per
group): for every family of ``hf_families.FAMILIES``, at world size 2 against plain HF
(fp32, rtol 1e-5 / atol 1e-6): the default policy (traced), ``save`` and ``trace=False``;
``weights=`` from a ``save_pretrained`` folder (bitwise); ``fz3.export`` read back by
``from_pretrained`` with its logits equal to ``fz3.apply(..., output="logits")`` (bitwise);
PEFT LoRA on the attention projections against plain PEFT, and ``fz3.hf.export_peft`` read
back by ``PeftModel.from_pretrained``; the MoE families with their router's load-balancing
loss under every step. A family the installed transformers lacks is
skipped, by name."""

from __future__ import annotations

import pytest

import dist
from hf_families import (EVERY_STEP, FAMILIES, ROUTED, build, finetune_ranks, router_loss_ranks,
                         save_families)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_fine_tunes_and_exports(family, tmp_path):
    if build(family) is None:
        pytest.skip(f"the installed transformers has no {family}")
    save_families(tmp_path, [family])
    assert dist.run(2, finetune_ranks, str(tmp_path), [family], EVERY_STEP, True,
                    timeout=600) == ["ok"] * 2


@pytest.mark.parametrize("family", ROUTED)
def test_moe_family_with_the_router_loss(family):
    """With ``output_router_logits=True``: every step of ``EVERY_STEP`` against plain HF."""
    if build(family) is None:
        pytest.skip(f"the installed transformers has no {family}")
    assert dist.run(2, router_loss_ranks, (family,), EVERY_STEP, timeout=600) == ["ok"] * 2
