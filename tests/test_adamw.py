"""fz3's fused AdamW with weight-decay masks of every shape it accepts, against torch's AdamW.

The fused path splits each row into runs of decayed and undecayed elements; torch's AdamW
decays whole tensors, so the reference runs two copies (decay on, decay off) and takes each
element from the copy its mask says. One process: the optimizer is elementwise, no rank
talks to another.
"""

import torch

import fz3
from fz3.optim.adamw import SLICE_MIN_ELEMENTS

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
N = 3 * SLICE_MIN_ELEMENTS  # rows long enough to be sliced, not given a masked pass


def _masks() -> tuple[torch.Tensor, ...]:
    a = torch.zeros(2, N, dtype=torch.bool)  # rows that differ: each row its own runs
    a[0, : N // 2] = True
    a[1, -N // 3:] = True
    b = torch.tensor([[True], [False], [True]])  # (3, 1): one decay per row
    c = torch.zeros(1, N, dtype=torch.bool)  # (1, n): one row shared by every row (decay_mask)
    c[0, 100:N - 5000] = True
    d = torch.zeros(1, 64, dtype=torch.bool)  # short rows: the masked pass instead of slices
    d[0, ::3] = True
    return a, b, c, d


def test_fused_adamw_masks_match_torch():
    masks = _masks()
    g = torch.Generator().manual_seed(0)
    shapes = [(2, N), (3, N), (4, N), (5, 64)]
    params = tuple(torch.randn(s, generator=g) for s in shapes)
    grads = [tuple(torch.randn(s, generator=g) for s in shapes) for _ in range(3)]
    refs = {wd: [p.clone().requires_grad_() for p in params] for wd in (0.1, 0.0)}
    torch_opts = {wd: torch.optim.AdamW(refs[wd], weight_decay=wd, **HP) for wd in refs}
    opt = fz3.optim.adamw(**HP, weight_decay=0.1, mask=masks)
    mine = tuple(p.clone() for p in params)
    state = opt.init(mine)
    for step_grads in grads:
        mine, state = fz3.optim.step(opt, step_grads, state, mine, donate=True)
        for wd, ps in refs.items():
            for p, gr in zip(ps, step_grads):
                p.grad = gr.clone()
            torch_opts[wd].step()
    for i, (got, mask) in enumerate(zip(mine, masks)):
        want = torch.where(mask, refs[0.1][i].detach(), refs[0.0][i].detach())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"leaf {i}: {m}")
