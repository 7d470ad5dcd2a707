"""Traced layers keep no more than autograd would: each layer's traced residuals (the tensors
its forward program keeps for its backward, deduplicated by storage, the parameter row and the
layer's input left out) against what eager autograd saves for the same layer
(``saved_tensors_hooks``, the parameters and the input left out), for fz3's GPT block, an
RMSNorm + SwiGLU block and Hugging Face Llama, Qwen2, Mistral, Gemma, Phi3 and GPT-2 layers
built from tiny configs and called directly. The partition that put the cotangent-free parts
of ``pow``'s and ``rsqrt``'s derivatives into the forward kept 10-13% more on every RMSNorm
model (two activation-sized tensors more per Llama layer)."""

from __future__ import annotations

import math
from collections import Counter

import optree
import pytest
import torch
from torch import nn

from fz3.models.gpt import GPT, GPTConfig
from fz3.step import joint

B, T, D = 2, 16, 64


class RMSSwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.gate, self.up, self.down = nn.Linear(D, 128), nn.Linear(D, 128), nn.Linear(128, D)

    def forward(self, h):
        x = self.norm(h)
        return h + self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class Called(nn.Module):
    """A Hugging Face decoder layer called as its model calls it: rotary tables as inputs."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, h, *rotary):
        kw = {"position_embeddings": tuple(rotary)} if rotary else {}
        out = self.layer(h, attention_mask=None, **kw)
        return out[0] if isinstance(out, tuple) else out


def _hf(family: str):
    import transformers as tf

    common = dict(vocab_size=97, hidden_size=D, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=97, n_positions=T, n_embd=D,
                                                 n_layer=1, n_head=4))
        return Called(model.transformer.h[0]), ()
    config = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig,
              "gemma": tf.GemmaConfig, "phi3": tf.Phi3Config}[family]
    extra = {"head_dim": D // 4} if family == "gemma" else {}
    model = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
             "mistral": tf.MistralForCausalLM, "gemma": tf.GemmaForCausalLM,
             "phi3": tf.Phi3ForCausalLM}[family](config(**common, **extra))
    h = torch.zeros(B, T, D)
    cos, sin = model.model.rotary_emb(h, position_ids=torch.arange(T)[None])
    return Called(model.model.layers[0]), (cos, sin)


def _layer(name: str):
    torch.manual_seed(0)
    if name == "fz3 gpt":
        return GPT(GPTConfig(vocab=97, seq=T, dim=D, heads=4, layers=1)).blocks[0], ()
    if name == "rmsnorm swiglu":
        return RMSSwiGLU(), ()
    return _hf(name)


def _stored(tensors, skip: set[int]) -> dict[int, tuple[int, tuple]]:
    """``{storage: (bytes, shape)}`` of the tensors (in any nesting of tuples) whose storage is
    not in ``skip``."""
    out = {}
    for t in optree.tree_leaves(list(tensors)):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in skip:
            out[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), tuple(t.shape))
    return out


def as_layer(block: nn.Module):
    """The block as fz3 traces a layer: ``(a pure function of one flat parameter row, the
    row)``."""
    names, shapes = zip(*((n, p.shape) for n, p in block.named_parameters()))
    sizes = [math.prod(s) for s in shapes]

    def layer(row, frozen_row, h, *extras):
        params = {n: t.view(s) for n, t, s in zip(names, row.split(sizes), shapes)}
        return torch.func.functional_call(block, params, (h, *extras))

    return layer, torch.cat([p.detach().reshape(-1) for p in block.parameters()])


def traced_residuals(block: nn.Module, h: torch.Tensor, extras) -> tuple[dict, torch.Tensor]:
    layer, row = as_layer(block)
    programs = joint.trace(layer, [row, h, *extras], False, [])
    out, *residuals = programs.forward(row, h, *extras)
    assert all(isinstance(t, torch.Tensor) for t in residuals), [type(t) for t in residuals]
    skip = {row.untyped_storage().data_ptr(), h.untyped_storage().data_ptr()}
    return _stored(residuals, skip), out


def autograd_saved(block: nn.Module, h: torch.Tensor, extras) -> tuple[dict, torch.Tensor]:
    x = h.clone().requires_grad_()
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()}
    skip.add(x.untyped_storage().data_ptr())
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = block(x, *extras)
    return _stored(saved, skip), out.detach()


@pytest.mark.parametrize("name", ["fz3 gpt", "rmsnorm swiglu", "llama", "qwen2", "mistral",
                                  "gemma", "phi3", "gpt2"])
def test_traced_layers_keep_no_more_than_autograd(name):
    block, extras = _layer(name)
    block.eval()  # dropout off: the same forward in both
    h = torch.randn(B, T, D)
    traced, out = traced_residuals(block, h, extras)
    eager, want = autograd_saved(block, h, extras)
    assert torch.equal(out, want), name  # the same forward, bit for bit
    mine, theirs = sum(b for b, _ in traced.values()), sum(b for b, _ in eager.values())
    extra = sorted((Counter(traced.values()) - Counter(eager.values())).elements())
    assert mine <= theirs, (f"{name}: traced residuals {mine} B > autograd's saved tensors "
                            f"{theirs} B; kept beyond autograd (bytes, shape): {extra}")


# The memory plan measures the engine that runs (issue 23): a traced layer by its programs
# (its residuals read from the trace; selective recompute's by its own), one run through
# autograd by autograd's graph.


def _llama():
    import transformers as tf

    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=97, hidden_size=D, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))


def plan_vs_live_ranks(rank, world):
    import fz3
    from fz3.observe.live_bytes import LiveBytes

    out = []
    ids = torch.randint(3, 97, (4, 64), generator=torch.Generator().manual_seed(rank))
    batch = {"input_ids": ids, "labels": ids.clone()}
    for dtype in (torch.float32, torch.bfloat16):
        model, params = fz3.shard(_llama(), precision=fz3.Precision(dtype, torch.float32))
        for policy in (fz3.Policy(), fz3.Policy(activations="save"),
                       fz3.Policy(activations="selective")):
            sched = fz3.plan(model, policy)
            for trace in (True, False):
                plan = fz3.memory_plan(model, sched, batch, trace=trace)
                step = fz3.value_and_grad(model, sched, trace=trace)
                step(params, batch)  # warm: nothing cached on the first call is counted
                with LiveBytes(writes=True) as live:
                    step(params, batch)
                    torch.distributed.barrier()  # gloo lets its last tensors go
                predicted = plan.peak - plan.params - plan.optimizer
                what = (str(dtype), policy.activations, trace, predicted, live.peak)
                # 0.954-1.005 here (bf16 lowest: a prefetched unit's cast shard, the
                # gather's input, is not counted); measured by the other engine, the traced
                # recompute plan is 5.5% over (autograd's layer peaks): this fails
                assert abs(predicted / live.peak - 1) <= 0.05, what
                assert trace is False or step.traced.failed == {}, step.traced.failed
                out.append(what)
    return out


def test_memory_plan_measures_the_engine_that_runs():
    import dist

    got = {what[:3]: what[3:] for what in dist.run(2, plan_vs_live_ranks, timeout=300)[0]}
    assert len(got) == 12
    for dtype in ("torch.float32", "torch.bfloat16"):
        # selective keeps less than save, more than recompute (live bytes)
        assert got[dtype, "recompute", True][1] < got[dtype, "selective", True][1] \
            < got[dtype, "save", True][1], got
        # untraced, a selective unit runs as recompute and is planned so
        assert got[dtype, "selective", False] == got[dtype, "recompute", False], got


def plan_in_its_mode_ranks(rank, world):
    """A plan traces the layers (the step reuses the programs): in the planned model's mode,
    whatever mode the module was in, so eval steps after an eval plan draw no dropout."""
    import fz3
    from fz3.models import shard_gpt
    from fz3.models.gpt import synthetic_batch

    cfg = GPTConfig(vocab=37, seq=8, dim=16, heads=2, layers=2, dropout=0.5)
    for module_train, planned_train in ((True, False), (False, True)):
        torch.manual_seed(0)
        module = GPT(cfg).train(module_train)
        model, params = shard_gpt(module)
        planned = model.train(planned_train)
        batch = synthetic_batch(cfg, 2, seed=rank)
        fz3.memory_plan(planned, fz3.plan(planned), batch)  # traces, in planned's mode
        torch.manual_seed(1)
        traced, _ = fz3.value_and_grad(planned)(params, batch)
        torch.manual_seed(1)
        plain, _ = fz3.value_and_grad(planned, trace=False)(params, batch)
        assert torch.equal(traced, plain), (module_train, planned_train, traced, plain)
    return "ok"


def test_a_plan_traces_in_the_models_mode():
    import dist

    assert dist.run(1, plan_in_its_mode_ranks) == ["ok"]
