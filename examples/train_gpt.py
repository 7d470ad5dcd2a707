"""Train a small GPT with fz3 on CPU ranks (gloo), character by character, on the Zen of Python.

    python examples/train_gpt.py                 # launches itself on 2 ranks via torch.distributed.run
    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 300
    # two "nodes" (here both on 127.0.0.1; on a cluster, the head node's address):
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 examples/train_gpt.py
    python examples/train_gpt.py --save-every 100 --ckpt /tmp/gpt   # then, after a stop:
    python examples/train_gpt.py --resume --ckpt /tmp/gpt             # continues where it left off

Every rank holds 1/N of each unit's parameters, gradients and AdamW moments; the step is
``fz3.value_and_grad`` + ``fz3.optim.adamw``, all pure functions of (params, state, batch).
"""

from __future__ import annotations

import argparse
import codecs
import os
import sys

import torch
import torch.distributed as dist

import fz3
from fz3.models.gpt import GPT, GPTConfig
from fz3.models import shard_gpt


def corpus() -> torch.Tensor:
    """The Zen of Python (shipped with CPython, ROT13 in ``this.s``) as bytes, repeated."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (prints the poem on import)
    text = codecs.decode(this.s, "rot13")
    return torch.tensor(list(text.encode()) * 4, dtype=torch.int64)


def batch_for(data: torch.Tensor, step: int, rank: int, per_rank: int, seq: int):
    g = torch.Generator().manual_seed(step * 1000 + rank)  # each rank its own samples
    starts = torch.randint(0, len(data) - seq - 1, (per_rank,), generator=g)
    window = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
    return window[:, :-1], window[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--nproc", type=int, default=2, help="ranks to launch when started without torchrun")
    ap.add_argument("--ckpt", default="checkpoints/gpt", help="checkpoint folder (fz3.save / fz3.load)")
    ap.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    ap.add_argument("--resume", action="store_true", help="continue from --ckpt if it exists")
    ap.add_argument("--replicate", type=int, default=1,
                    help="hybrid sharding: replicas of a (replicate, shard) mesh, e.g. the number of nodes")
    args = ap.parse_args()

    if "LOCAL_RANK" not in os.environ:  # started plainly: become torchrun
        from torch.distributed.run import main as torchrun

        torchrun(["--standalone", f"--nproc-per-node={args.nproc}", __file__, *sys.argv[1:]])
        return

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, seq=args.seq, dim=args.dim, heads=4, layers=args.layers)
    mesh = None
    if args.replicate > 1:  # shard inside each group of world/replicate ranks (a node), replicate across
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (args.replicate, world // args.replicate), mesh_dim_names=("replicate", "shard"))
    model, params = shard_gpt(GPT(cfg), mesh=mesh)
    opt = fz3.optim.adamw(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, mask=fz3.decay_mask(model))
    state = opt.init(params)
    step_fn = fz3.value_and_grad(model)
    data = corpus()
    if rank == 0:
        n = model.numel
        print(f"fz3: {n / 1e6:.2f}M parameters, {world} ranks ({model.comm.replicas} x {model.world_size}), "
              f"{model.num_layers} layers; "
              f"each rank holds {sum(t.numel() for t in params.parts)} of them", flush=True)

    start = 1
    if args.resume and (os.path.isdir(args.ckpt) or os.path.isdir(args.ckpt + ".old")):
        saved = fz3.load(args.ckpt, model, {"params": params, "opt": state, "step": 0})
        params, state, start = saved["params"], saved["opt"], saved["step"] + 1
        if rank == 0:
            print(f"resumed from {args.ckpt} at step {saved['step']}", flush=True)

    meter = fz3.Meter()  # the first step (it traces the layers) is timed apart from the rate
    for step in range(start, args.steps + 1):
        batch = batch_for(data, step, rank, args.batch, args.seq)
        loss, grads = step_fn(params, batch)
        updates, state = opt.update(grads, state, params)
        params = fz3.optim.apply_updates(params, updates)
        meter.tick(args.batch * args.seq * world)
        if rank == 0 and (step % args.log_every == 0 or step == start):
            print(f"step {step:5d}  loss {float(loss):.4f}  {meter.line('tokens')}", flush=True)
        if args.save_every and step % args.save_every == 0:
            fz3.save(args.ckpt, model, {"params": params, "opt": state, "step": step})
    fz3.destroy(model)  # collective: the model's process groups and heartbeat thread
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
