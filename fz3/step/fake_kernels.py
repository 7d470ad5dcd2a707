"""Fake kernels in fz3's traces (``fz3.step.joint`` traces a layer on fake tensors): the ops
whose fake kernel refuses what their real kernel takes, traced anyway through the
decomposition table handed to ``make_fx`` (``TABLE``); torch's fake-tensor logger is kept
quiet while a trace runs (``fz3.sharding.placement.quiet_fake_tensor_log``). Nothing of
torch is patched: a ``TABLE`` entry applies only inside fz3's traces, and only where the fake
kernel would refuse (it returns ``NotImplemented`` otherwise, and the op is traced as it
is).

``aten._grouped_mm`` (an MoE layer's experts: transformers calls it for every dtype on the
CPU): its fake kernel takes bf16 only (it checks the CUDA kernel's rules), while the CPU
kernel takes fp32 too, so an fp32 MoE layer could not be traced. In any dtype but bf16 it is
traced as ``fz3::grouped_mm``, an op of fz3's own whose real kernel is ``torch._grouped_mm``
itself and whose fake kernel gives the real one's output (shape, dtype, contiguous): the
programs call the very kernels eager autograd calls, forward and backward (autograd's
formula for ``_grouped_mm`` calls ``_grouped_mm``, and those calls meet the table too), so
a traced fp32 MoE layer equals ``trace=False`` bit for bit. In bf16 it is traced as before.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


@torch.library.custom_op("fz3::grouped_mm", mutates_args=())
def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor,
               offs: torch.Tensor | None) -> torch.Tensor:
    """``torch._grouped_mm(mat_a, mat_b, offs)``: the real kernel, called by the programs."""
    return torch._grouped_mm(mat_a, mat_b, offs)


@grouped_mm.register_fake
def _grouped_mm_fake(mat_a: torch.Tensor, mat_b: torch.Tensor,
                     offs: torch.Tensor | None) -> torch.Tensor:
    """The output the CPU kernel makes: (M, N) for rows grouped by ``offs`` ((M, K) x (G, K,
    N)) or columns ((G, M, K) x (K, N)); (G, M, N) for a contraction grouped by ``offs``
    ((M, K) x (K, N)) or a batch ((G, M, K) x (G, K, N)); contiguous."""
    a3, b3 = mat_a.dim() == 3, mat_b.dim() == 3
    if not a3 and not b3:
        shape = (offs.shape[0], mat_a.shape[0], mat_b.shape[1])
    elif not a3:
        shape = (mat_a.shape[0], mat_b.shape[-1])
    elif not b3:
        shape = (mat_a.shape[1], mat_b.shape[1])
    else:
        shape = (mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1])
    return mat_a.new_empty(shape)


def _grouped_mm_traced(mat_a: torch.Tensor, mat_b: torch.Tensor,
                       offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None):
    """``_grouped_mm`` as ``fz3::grouped_mm`` where its fake kernel refuses the dtype (not
    bf16); as it is otherwise, and with a bias or an output dtype (no fz3 form)."""
    if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
        return NotImplemented
    if bias is not None or (out_dtype is not None and out_dtype != mat_a.dtype):
        return NotImplemented
    return grouped_mm(mat_a, mat_b, offs)


TABLE = {aten._grouped_mm.default: _grouped_mm_traced}
