"""The random-number state a step depends on: the CPU generator and, on CUDA, the device's.

Recompute replays a layer's forward in its backward with the RNG state the forward started
from, so dropout masks (and anything else drawn at random, on the CPU generator or the
device's) repeat exactly, as ``torch.utils.checkpoint`` does. Checkpoints save the same state.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class RngState(NamedTuple):
    cpu: torch.Tensor  # torch.get_rng_state()
    device: torch.Tensor | None  # torch.cuda.get_rng_state(device); None on CPU


def capture(device: torch.device) -> RngState:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return RngState(torch.get_rng_state(), cuda)


def restore(state: RngState, device: torch.device) -> None:
    torch.set_rng_state(state.cpu)
    if state.device is not None:
        torch.cuda.set_rng_state(state.device, device)


def pack(state: RngState) -> torch.Tensor:
    """One uint8 tensor (for checkpoints): the CPU state, then the device's if any."""
    return state.cpu if state.device is None else torch.cat([state.cpu, state.device])


def unpack(packed: torch.Tensor, device: torch.device) -> RngState:
    cpu = torch.get_rng_state().numel()
    return RngState(packed[:cpu].clone(), packed[cpu:].clone() if device.type == "cuda" else None)
