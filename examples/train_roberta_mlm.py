"""The seed's model, scaled down: a Hugging Face RobertaForMaskedLM trained with fz3 on CPU ranks.

    python examples/train_roberta_mlm.py            # launches itself on 2 ranks (needs fz3[hf])

The seed (DeepSpeed issue) trained a 10B RobertaForMaskedLM (30 layers, hidden 5120,
intermediate 20480, gradient checkpointing) with ZeRO-3. This is the same architecture at
4 layers, hidden 128, built from a config with random init; ``fz3.shard(model)`` recognises
it (no pre/post needed), recomputes each layer in backward (the default, like
``gradient_checkpointing: true``) and trains it on byte-level MLM over the Zen of Python.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import fz3

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import corpus  # noqa: E402


MASK, VOCAB = 256, 260  # bytes, then the <mask> id; 4 ids spare for specials


def mlm_batch(data: torch.Tensor, step: int, rank: int, per_rank: int, seq: int, masked: int):
    """Byte windows with exactly ``masked`` positions per row replaced by <mask> (labels elsewhere
    -100): every rank then averages over the same number of tokens (see fz3.hf)."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    starts = torch.randint(0, len(data) - seq, (per_rank,), generator=g).tolist()
    ids = torch.stack([data[s : s + seq] for s in starts]) + 0  # +0: a copy, we edit it
    labels = torch.full_like(ids, -100)
    for row in range(per_rank):
        where = torch.randperm(seq, generator=g)[:masked]
        labels[row, where] = ids[row, where]
        ids[row, where] = MASK
    return {"input_ids": ids, "labels": labels}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    if "LOCAL_RANK" not in os.environ:
        from torch.distributed.run import main as torchrun

        torchrun(["--standalone", f"--nproc-per-node={args.nproc}", __file__, *sys.argv[1:]])
        return

    from transformers import RobertaConfig, RobertaForMaskedLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = RobertaConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=512, max_position_embeddings=args.seq + 2, type_vocab_size=1)
    model, params = fz3.shard(RobertaForMaskedLM(cfg))  # built-in adapter: no pre/post needed
    opt = fz3.optim.chain(fz3.optim.clip_by_global_norm(1.0, model),
                          fz3.optim.adamw(lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01,
                                          mask=fz3.decay_mask(model)))
    state = opt.init(params)
    step_fn = fz3.value_and_grad(model)
    data = corpus()
    if rank == 0:
        n = model.numel
        print(f"fz3 RobertaForMaskedLM: {n / 1e6:.2f}M parameters on {world} ranks", flush=True)
    meter = fz3.Meter()  # the first step (it traces the layers) is timed apart from the rate
    for step in range(1, args.steps + 1):
        loss, grads = step_fn(params, mlm_batch(data, step, rank, args.batch, args.seq, masked=args.seq // 8))
        params, state = fz3.optim.step(opt, grads, state, params, donate=True)
        meter.tick(args.batch * world)
        if rank == 0 and (step % args.log_every == 0 or step == 1):
            print(f"step {step:4d}  mlm loss {float(loss):.4f}  grad norm {float(state[0].norm):.3f}  "
                  f"{meter.line('seq')}", flush=True)
    fz3.destroy(model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
