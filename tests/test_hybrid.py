"""Hybrid sharding on a 2-D DeviceMesh (replicate x shard) against the plain model, at mesh
shapes (1x4), (2x2), (4x1); and a checkpoint written under (2x2) read back under (1x4)."""

from __future__ import annotations

import os

import optree
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import dist
import fz3
from fz3.models.gpt import GPTConfig
from fz3.models import shard_gpt
from reference import assert_close, assert_rel_norm, batches, clone, concat, gpt, reference_grads

CFG = GPTConfig(vocab=37, seq=8, dim=36, heads=4, layers=3, tie=True)


def hybrid_ranks(rank, world, folder):
    module = gpt(CFG)
    bs = batches(CFG, world)
    ref_loss, ref = reference_grads(module, bs)
    for shape in ((1, 4), (2, 2), (4, 1)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        model, params = shard_gpt(module, mesh=mesh)
        assert model.world_size == shape[1] and model.comm.replicas == shape[0]
        for policy in (fz3.Policy(), fz3.Policy(activations="save", reduce="all_reduce", layers_per_unit=2),
                       fz3.Policy(join_grads=True)):  # each unit's rows summed over replicas
            loss, grads = fz3.value_and_grad(model, policy)(params, bs[rank])
            assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss), (shape, float(loss), ref_loss)
            got = fz3.full_state_dict(model, grads)
            if rank == 0:
                assert_close(got, ref, what=f"hybrid {shape} {policy}")
        if shape == (2, 2):
            # train_step's update waits for its unit's sum over replicas: value_and_grad +
            # optim.step's bits (trace=False: tracing costs seconds)
            adam = fz3.optim.adamw(lr=1e-3, weight_decay=0.1)
            a = clone((params, adam.init(params)))
            b = clone(a)
            _, g = fz3.value_and_grad(model, trace=False)(a[0], bs[rank])
            a = fz3.optim.step(adam, g, a[1], a[0], donate=True)
            _, *b = fz3.train_step(model, adam, trace=False)(b[0], b[1], bs[rank])
            assert all(torch.equal(x, y)
                       for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)))
        # two optimizer steps keep the replicas identical and match torch on the whole batch
        opt = fz3.optim.chain(fz3.optim.clip_by_global_norm(1.0, model),
                              fz3.optim.adamw(lr=1e-3, weight_decay=0.1))
        state = opt.init(params)
        torch_ref = gpt(CFG)
        topt = torch.optim.AdamW(torch_ref.parameters(), lr=1e-3, weight_decay=0.1)
        p = params
        for s in range(2):
            b = batches(CFG, world, step=s)
            _, g = fz3.value_and_grad(model)(p, b[rank])
            p, state = fz3.optim.step(opt, g, state, p, donate=True)
            topt.zero_grad()
            torch_ref(*concat(b)).backward()
            norm = torch.nn.utils.clip_grad_norm_(torch_ref.parameters(), 1.0)
            # the norm of R identical replicas is the norm of one (a sum over the world: sqrt(R) x)
            torch.testing.assert_close(state[0].norm, norm, rtol=1e-5, atol=0, msg=f"{shape} norm")
            topt.step()
        got = fz3.full_state_dict(model, p)
        if rank == 0:
            assert_rel_norm(got, dict(torch_ref.named_parameters(remove_duplicate=False)), 1e-5, what=f"{shape}")
        if shape == (2, 2):
            fz3.save(os.path.join(folder, "hsdp"), model, {"params": p})
            saved = got
    mesh = init_device_mesh("cpu", (1, 4))
    model, params = shard_gpt(gpt(CFG), mesh=mesh)
    loaded = fz3.load(os.path.join(folder, "hsdp"), model, {"params": params})["params"]
    got = fz3.full_state_dict(model, loaded)
    if rank == 0:
        assert all(torch.equal(got[n], saved[n]) for n in saved)
    return "ok"


def test_hybrid_sharding_meshes(tmp_path):
    assert dist.run(4, hybrid_ranks, str(tmp_path), timeout=240) == ["ok"] * 4


def test_mesh_of_three_dims_is_refused():
    class Mesh:
        ndim, shape = 3, (1, 1, 1)

    with pytest.raises(ValueError, match="mesh has 3 dims"):
        fz3.shard(torch.nn.Linear(1, 1), "x", lambda m, b: b, lambda m, h, b: h, mesh=Mesh())
