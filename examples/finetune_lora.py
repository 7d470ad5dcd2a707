"""LoRA fine-tuning of a Llama-shaped model with fz3 on CPU ranks (gloo), from a checkpoint on disk.

    pip install -c constraints.txt -e ".[hf]"
    python examples/finetune_lora.py    # launches itself on 2 ranks via torch.distributed.run
    torchrun --nproc-per-node 2 examples/finetune_lora.py --steps 100

1. Rank 0 writes a "pretrained" checkpoint with ``save_pretrained`` (random weights: there
   is no model hub here), unless ``--base`` already holds one.
2. Every rank builds the model on the meta device (no weights), wraps it with PEFT's LoRA
   (``fz3.hf.init_lora`` gives the new LoRA weights their values) and ``fz3.shard(...,
   weights=base)`` reads only this rank's slices of the checkpoint: no rank ever holds the
   whole model. The base weights are frozen: no gradient, no optimizer state.
3. A few steps on the Zen of Python, byte by byte; then ``fz3.hf.export_peft`` writes the
   adapter (``adapter_model.safetensors``, ``adapter_config.json``), which
   ``PeftModel.from_pretrained(base_model, out)`` loads.
"""

from __future__ import annotations

import argparse
import codecs
import os
import sys

import torch
import torch.distributed as dist

import fz3


def corpus() -> torch.Tensor:
    """The Zen of Python (shipped with CPython, ROT13 in ``this.s``) as bytes, repeated."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (prints the poem on import)
    return torch.tensor(list(codecs.decode(this.s, "rot13").encode()) * 4, dtype=torch.int64)


def batch_for(data: torch.Tensor, step: int, rank: int, per_rank: int, seq: int) -> dict:
    g = torch.Generator().manual_seed(step * 1000 + rank)  # each rank its own samples
    starts = torch.randint(0, len(data) - seq, (per_rank,), generator=g)
    ids = torch.stack([data[s : s + seq] for s in starts.tolist()])
    return {"input_ids": ids, "labels": ids.clone()}  # the model shifts the labels itself


def config(args: argparse.Namespace):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=args.dim,
        intermediate_size=4 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument(
        "--nproc", type=int, default=2, help="ranks to launch when started without torchrun"
    )
    ap.add_argument(
        "--base", default="checkpoints/llama-base", help="the pretrained checkpoint folder"
    )
    ap.add_argument("--out", default="checkpoints/llama-lora", help="where the adapter is written")
    args = ap.parse_args()

    if "LOCAL_RANK" not in os.environ:  # started plainly: become torchrun
        from torch.distributed.run import main as torchrun

        torchrun(["--standalone", f"--nproc-per-node={args.nproc}", __file__, *sys.argv[1:]])
        return

    import transformers
    from peft import LoraConfig, get_peft_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(args)
    if rank == 0 and not os.path.exists(os.path.join(args.base, "config.json")):
        torch.manual_seed(0)  # the "pretrained" model: random weights, saved as HF does
        transformers.LlamaForCausalLM(cfg).save_pretrained(args.base)
        print(f"wrote a random-weight checkpoint to {args.base}", flush=True)
    dist.barrier()

    with torch.device("meta"):  # no weights: fz3.shard reads this rank's slices from disk
        base = transformers.LlamaForCausalLM(cfg)
    torch.manual_seed(1)  # every rank alike: the same LoRA weights everywhere
    lora = LoraConfig(
        r=args.rank,
        lora_alpha=2 * args.rank,
        lora_dropout=0.0,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    )
    model, params = fz3.shard(fz3.hf.init_lora(get_peft_model(base, lora)), weights=args.base)
    if rank == 0:
        print(
            f"{world} ranks, {model.numel:,} parameters, {model.trained_numel:,} trained "
            f"(LoRA r={args.rank})",
            flush=True,
        )

    opt = fz3.optim.adamw(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state = opt.init(params)
    step_fn = fz3.value_and_grad(model)
    data = corpus()
    meter = fz3.Meter()  # the first step (it traces the layers) is timed apart from the rate
    for step in range(1, args.steps + 1):
        loss, grads = step_fn(params, batch_for(data, step, rank, args.batch, args.seq))
        params, state = fz3.optim.step(opt, grads, state, params, donate=True)
        meter.tick(args.batch * args.seq * world)
        if rank == 0 and (step % args.log_every == 0 or step == 1):
            print(f"step {step:5d}  loss {float(loss):.4f}  {meter.line('tokens')}", flush=True)
    files = fz3.hf.export_peft(args.out, model, params)
    if rank == 0:
        print(f"adapter written to {args.out}: {', '.join(files)}", flush=True)
    fz3.destroy(model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
