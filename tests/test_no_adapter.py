"""A model fz3 cannot run by itself, Hugging Face or not, is refused with one message
(``fz3/sharding/candidates.py``): the layer containers it holds (path, count, whether the
children are alike, whether they can be called ``layer(h, *extras)``), ``layers=``/``pre=``/
``post=``,
``call_layer=``, ``assign=`` and the README section; a container whose children have no
``forward`` of their own is refused at ``fz3.shard`` naming ``call_layer=``. Local: these
refusals come before any collective, so no process group is needed."""

from __future__ import annotations

import pytest
from torch import nn

import fz3


class Block(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, h):
        return h + self.mlp(self.norm(h))


class ViTLike(nn.Module):
    """timm's shape: blocks in an nn.Sequential, a head registered after them."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.Sequential(*[Block() for _ in range(3)])
        self.heads = nn.ModuleList([nn.Linear(8, 2), nn.Linear(8, 3)])  # not alike
        self.head = nn.Linear(8, 10)


class XTransformersLike(nn.Module):
    """x-transformers' shape: each layer a ModuleList of (norm, block), no forward of its own."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList([nn.ModuleList([nn.LayerNorm(8), nn.Linear(8, 8)])
                                     for _ in range(2)])


def test_a_model_with_no_adapter_is_refused_naming_its_containers():
    with pytest.raises(TypeError, match=r"no built-in adapter for ViTLike; layer containers in "
                                        r"it: 'blocks' \(Sequential of 3 x Block, all alike\); "
                                        r"'heads' \(ModuleList of 2 x Linear, not all alike: "
                                        r"one stack per run of alike ones\); pass "
                                        r"layers='blocks' .*pre=.*post=.*call_layer=.*assign=.*"
                                        r"'A model without a built-in adapter'"):
        fz3.shard(ViTLike())
    with pytest.raises(TypeError, match=r"'layers' \(ModuleList of 2 x ModuleList, all alike, no "
                                        r"forward of their own: needs call_layer=\)"):
        fz3.shard(XTransformersLike())
    with pytest.raises(TypeError, match=r"no built-in adapter for Linear; layer containers in "
                                        r"it: none"):
        fz3.shard(nn.Linear(2, 2))


def test_children_with_no_forward_are_refused_at_shard_naming_call_layer():
    """Before any collective (no process group here): torch's 'missing the required forward'
    would come from inside the first step."""
    model = XTransformersLike()
    with pytest.raises(TypeError, match=r"layers='layers' holds ModuleLists, which have no "
                                        r"forward of their own, and fz3.shard got no "
                                        r"call_layer=: pass call_layer="):
        fz3.shard(model, "layers", lambda m, b: m.embed(b), lambda m, h, b: h.sum())
