"""The Hugging Face families' tiny models, batches and checks, shared by
``tests/test_hf_families.py`` (each family once, one per group fine-tuned) and
``tests/hf_zoo.py`` (the whole matrix). Not a test file: pytest does not collect it."""

from __future__ import annotations

import copy
import warnings

import torch

import fz3
from reference import assert_close

COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # BERT's
# 4 experts, 2 per token (each family reads its own names)
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# model_type -> (config class name, its extra settings): each family's own features switched
# on, dropout off where it defaults on (each rank draws its own masks)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(sliding_window=4)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=8)),
    "phi3": ("Phi3Config", {}),
    "olmo": ("OlmoConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "stablelm": ("StableLmConfig", {}),
    "granite": ("GraniteConfig", dict(embedding_multiplier=2.0, logits_scaling=4.0,
                                      residual_multiplier=0.5, attention_multiplier=0.3)),
    "gemma": ("GemmaConfig", dict(head_dim=8)),
    "gemma2": ("Gemma2Config", dict(head_dim=8, sliding_window=4, final_logit_softcapping=5.0,
                                    attn_logit_softcapping=None)),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=8, sliding_window=4,
                                             final_logit_softcapping=5.0,
                                             sliding_window_pattern=2)),
    "gpt_neox": ("GPTNeoXConfig", {}),
    "gptj": ("GPTJConfig", dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64)),
    "opt": ("OPTConfig", dict(ffn_dim=64, dropout=0.0, word_embed_proj_dim=16)),
    "bloom": ("BloomConfig", dict(n_layer=2, n_head=4)),
    "falcon": ("FalconConfig", dict(num_kv_heads=2, new_decoder_architecture=True)),
    "mixtral": ("MixtralConfig", MOE),
    "qwen2_moe": ("Qwen2MoeConfig", dict(MOE, mlp_only_layers=[1],
                                         shared_expert_intermediate_size=32)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(MOE, head_dim=8)),
    "olmoe": ("OlmoeConfig", MOE),
    "bert": ("BertConfig", NO_DROPOUT),
    "modernbert": ("ModernBertConfig", dict(num_hidden_layers=3, global_attn_every_n_layers=2,
                                            local_attention=4, cls_token_id=1,
                                            sep_token_id=2)),
}
MASKED = ("bert", "modernbert")  # AutoModelForMaskedLM; the others AutoModelForCausalLM
# model_type -> what its stacks' fallback to autograd says, where they may fall back: Falcon's
# attention makes a tensor from Python values. (The MoE families' experts in fp32 trace,
# through fz3.step.fake_kernels; 5.0's GPT-J attention's rotary buffer is an input of its
# programs.)
FALLS_BACK = {"falcon": "makes a tensor from Python values"}


# the MoE families, and their router's load-balancing loss switched on (a coefficient large
# enough that a wrong term shows at rtol 1e-5; transformers' default is 0.001)
ROUTED = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
ROUTER = dict(output_router_logits=True, router_aux_loss_coef=0.5)


def build(family: str, settings: dict | None = None):
    """The tiny model of ``family`` (``settings`` added to its config), or None where the
    installed transformers lacks it."""
    import transformers as tf

    name, extra = FAMILIES[family]
    extra = {**extra, **(settings or {})}
    config_class = getattr(tf, name, None)
    if config_class is None:
        return None
    torch.manual_seed(0)
    auto = tf.AutoModelForMaskedLM if family in MASKED else tf.AutoModelForCausalLM
    with warnings.catch_warnings():
        # transformers 5.0's ModernBERT module calls torch.compile as it is imported, and
        # importing inductor warns that torch.jit.script_method is deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        return auto.from_config(config_class(**{**COMMON, **extra}))


def batch(rank: int) -> dict:
    """A left-padded row and 18 labelled tokens on every rank (causal and masked alike)."""
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, 97, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 0] = -100  # the same number of labelled tokens on every rank
    labels[1, 1] = -100
    labels[1, 2] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def reference(module, bs: list[dict]):
    """Plain HF autograd over every rank's batch: ``(loss, {name: grad})``."""
    ref = copy.deepcopy(module)
    loss = ref(**{k: torch.cat([b[k] for b in bs]) for k in bs[0]}).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)
                           if p.grad is not None}


def reference_per_rank(module, bs: list[dict]):
    """Plain HF autograd, each rank's batch on its own (the load-balancing loss is a product
    of means over a batch's tokens, so a rank's is its own batch's, as under DDP): ``(mean
    loss, {name: grad of the mean}, [each rank's aux_loss])``."""
    ref = copy.deepcopy(module)
    total, aux = 0.0, []
    for b in bs:
        out = ref(**b)
        (out.loss / len(bs)).backward()
        total += float(out.loss) / len(bs)
        aux.append(out.aux_loss.detach())
    return total, {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)
                   if p.grad is not None}, aux


def router_loss_ranks(rank, world, families=ROUTED, steps=({},)):
    """Per MoE family with ``ROUTER``: fz3's loss and every gradient equal plain HF's (each
    rank's own batch, ``reference_per_rank``), and ``fz3.hf.losses`` reports this rank's
    ``aux_loss`` as HF's output does."""
    bs = [batch(r) for r in range(world)]
    for family in families:
        module = build(family, ROUTER)
        if module is None:
            continue
        want_loss, want, aux = reference_per_rank(module, bs)
        model, params = fz3.shard(module)
        assert model.layer_aux, family
        for kw in steps:
            loss, grads = fz3.value_and_grad(model, **kw)(params, bs[rank])
            torch.testing.assert_close(float(loss), want_loss, rtol=1e-5, atol=1e-6,
                                       msg=f"{family} {kw}")
            got = fz3.full_state_dict(model, grads)
            if rank == 0:
                assert_close(got, want, what=f"{family} {kw}")
        (total, terms), _ = fz3.value_and_grad(model, loss=fz3.hf.losses,
                                               has_aux=True)(params, bs[rank])
        torch.testing.assert_close(terms["aux_loss"], aux[rank], rtol=1e-5, atol=1e-6,
                                   msg=family)
        torch.testing.assert_close(float(total), want_loss, rtol=1e-5, atol=1e-6, msg=family)
    return "ok"


def check_traced(family: str, failed: dict) -> None:
    """Nothing fell back, or only the stack of a family ``FALLS_BACK`` names, for its reason."""
    if family in FALLS_BACK:
        assert all(FALLS_BACK[family] in why for why in failed.values()), (family, failed)
    else:
        assert failed == {}, (family, failed)


# model_type -> LoRA targets (its attention's query and value projections, as PEFT's own
# tables name them)
LORA = {**dict.fromkeys(FAMILIES, ["q_proj", "v_proj"]), "phi3": ["qkv_proj"],
        "gpt_neox": ["query_key_value"], "bloom": ["query_key_value"],
        "falcon": ["query_key_value"], "bert": ["query", "value"], "modernbert": ["Wqkv"]}
# the README's test command fine-tunes one family per group: Llama-like, Gemma-like (sliding
# layers, soft-capping), GPT-NeoX-like, encoders, MoE (its per-expert checkpoint tensors read
# into the stacked experts); .ci/hf-zoo runs every family
FINETUNED = ("qwen2", "gemma2", "gpt_neox", "bert", "mixtral")
SAVE = [dict(schedule=fz3.Policy(activations="save"))]
# the zoo's steps, each against plain HF: the default (traced), save, and untraced
EVERY_STEP = [{}, *SAVE, dict(trace=False)]


def finetune_ranks(rank, world, folder, families, steps=SAVE, peft_export=False):
    """Per family: ``full_model`` and ``lora`` below."""
    bs = [batch(r) for r in range(world)]
    for family in families:
        full_model(rank, folder, family, bs, steps)
        lora(rank, folder, family, bs, peft_export)
    return "ok"


def full_model(rank, folder, family, bs, steps) -> None:
    """Each of ``steps`` (``value_and_grad`` keywords) against plain HF at 1e-5 / 1e-6;
    ``weights=``: the shards read from ``save_pretrained``'s folder into a meta model give the
    real model's step (bitwise: the same values); export: ``from_pretrained`` of
    ``fz3.export``'s folder holds the module's weights and its logits equal ``fz3.apply(...,
    output="logits")`` bitwise."""
    import os

    import transformers as tf
    from test_hf_pretrained import on_meta

    real = build(family)
    ref_loss, ref_grads = reference(real, bs)
    model, params = fz3.shard(real)
    for kw in steps:
        loss, grads = fz3.value_and_grad(model, **kw)(params, bs[rank])
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=family)
        got = fz3.full_state_dict(model, grads)
        if rank == 0:
            assert_close(got, ref_grads, what=f"{family} {kw}")
    want = fz3.value_and_grad(model)(params, bs[rank])
    meta_model, meta_params = fz3.shard(on_meta(real), weights=os.path.join(folder, family))
    got = fz3.value_and_grad(meta_model)(meta_params, bs[rank])
    assert torch.equal(got[0], want[0]), family
    assert all(torch.equal(a, b) for a, b in zip(got[1].parts, want[1].parts)), family
    exported = os.path.join(folder, f"{family}-export")
    fz3.export(exported, model, params)
    torch.distributed.barrier()  # rank 0 wrote it
    auto = tf.AutoModelForMaskedLM if family in MASKED else tf.AutoModelForCausalLM
    loaded = auto.from_pretrained(exported).eval()
    assert_close(loaded.state_dict(), real.state_dict(), rtol=0, atol=0,
                 what=f"{family} exported")
    logits = fz3.apply(model.eval(), params, bs[rank], output="logits")
    with torch.no_grad():
        assert torch.equal(logits, loaded(**bs[rank]).logits), family


def lora(rank, folder, family, bs, peft_export) -> None:
    """PEFT LoRA (``init_lora_weights=False``, so ``lora_B`` is not zero) against plain PEFT
    autograd at 1e-5 / 1e-6; with ``peft_export``, ``PeftModel.from_pretrained`` of
    ``fz3.hf.export_peft``'s folder holds its LoRA weights."""
    import os

    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=LORA[family])
    peft = get_peft_model(build(family), config)
    ref_loss, expected = reference(peft, bs)
    assert expected and all(".lora_" in n for n in expected), sorted(expected)[:4]
    model, params = fz3.shard(peft)
    loss, grads = fz3.value_and_grad(model)(params, bs[rank])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=family)
    trained = fz3.full_state_dict(model, grads)
    if rank == 0:
        assert_close(trained, expected, what=f"LoRA {family}")
    if not peft_export:
        return
    adapter = os.path.join(folder, f"{family}-adapter")
    fz3.hf.export_peft(adapter, model, params)
    torch.distributed.barrier()
    mine = fz3.full_state_dict(model, params)  # rank 0's
    if rank == 0:
        assert_close(_adapter_back(family, adapter, PeftModel), mine, rtol=0, atol=0,
                     what=f"{family} export_peft")


def _adapter_back(family, adapter, peft_model) -> dict:
    """The LoRA weights ``PeftModel.from_pretrained`` reads from ``adapter``, by PEFT's names.
    peft 0.21.2 cannot load an MoE model's adapter on transformers 5.0 (its weight conversion
    calls ``WeightRenaming.convert(loading_info=...)``, which 5.0 lacks: plain PEFT fails so
    too): there the file itself is read, under the names PEFT saves (no adapter name)."""
    try:
        back = peft_model.from_pretrained(build(family), adapter)
    except TypeError as e:
        if "loading_info" not in str(e):
            raise
        from safetensors.torch import load_file

        saved = load_file(f"{adapter}/adapter_model.safetensors")
        return {n.replace(".weight", ".default.weight"): t for n, t in saved.items()}
    return {n: p for n, p in back.named_parameters() if ".lora_" in n}


def save_families(folder, families) -> list[str]:
    """``save_pretrained`` of each family the installed transformers has, under ``folder``."""
    found = [f for f in families if build(f) is not None]
    for family in found:
        build(family).save_pretrained(f"{folder}/{family}")
    return found
