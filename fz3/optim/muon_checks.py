"""What ``fz3.optim.muon`` refuses, named, before any collective: torch.optim.Muon's
hyper-parameter checks, parameters it cannot orthogonalize, and trees or states that do not fit
the model."""

from __future__ import annotations

import logging
from typing import Any

from ..schedule.structure import Role
from ..sharding.matrices import is_matrix
from ..sharding.model import ShardedModel
from ..sharding.params import Params, check_tree
from .checks import FIX_STATE, refuse_donated_tree

log = logging.getLogger("fz3.optim.muon")


def check_hyper(lr, weight_decay, momentum, coefficients, steps, adjust_lr_fn) -> None:
    """torch.optim.Muon's refusals, at construction."""
    if (not callable(lr) and lr < 0) or weight_decay < 0 or momentum < 0:
        raise ValueError(f"fz3.optim.muon: lr={lr}, weight_decay={weight_decay}, "
                         f"momentum={momentum} must be >= 0")
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"fz3.optim.muon: adjust_lr_fn={adjust_lr_fn!r}: pass None, 'original' "
                         f"or 'match_rms_adamw'")
    if len(coefficients) != 3 or not 0 < steps < 100:
        raise ValueError(f"fz3.optim.muon: ns_coefficients={coefficients} (three numbers) and "
                         f"ns_steps={steps} (1 to 99)")


def check_matrices(model: ShardedModel) -> None:
    """Refuse what Muon cannot orthogonalize, naming it; say once (rank 0) which 3-D
    parameters are orthogonalized one matrix per leading index (stacked experts)."""
    stacks = [p for p in model.parts if p.role is Role.STACK and p.layout.slots]
    if not stacks:
        raise ValueError("fz3.optim.muon: the model has no layer stack with trained parameters; "
                         "Muon orthogonalizes the 2-D parameters of layer stacks: use "
                         "fz3.optim.adamw for this model")
    experts = []
    for part in stacks:
        for s in part.layout.slots:
            if len(s.shape) > 3:
                raise ValueError(f"fz3.optim.muon: {part.prefix()}{s.name} is {list(s.shape)}: "
                                 f"Muon orthogonalizes 2-D parameters (3-D: one matrix per "
                                 f"leading index). Make it a 2-D parameter of the module (a "
                                 f"view in forward), or freeze it (requires_grad=False)")
            if len(s.shape) == 3:
                experts.append(f"{part.path}.*.{s.name} {list(s.shape)}")
        if not any(is_matrix(part, s) for s in part.layout.slots):
            raise ValueError(f"fz3.optim.muon: the layer stack {part.name} has no 2-D parameter "
                             f"to orthogonalize (it trains {[s.name for s in part.layout.slots]}):"
                             f" use fz3.optim.adamw, or train its matrices")
    if experts and model.is_root:
        log.info("fz3.optim.muon: %s orthogonalized per expert (one matrix per leading index)",
                 ", ".join(experts))


def check_state(model: ShardedModel, grads: Params, state: Any, params: Params | None,
                weight_decay: float) -> None:
    """The trees fit this model and the state (a ``MuonState``, checked by the caller) was built
    for it; refused naming the part, before any collective."""
    if params is None and weight_decay:
        raise ValueError("muon with weight_decay needs params: opt.update(grads, state, params)")
    check_tree(model, grads, "the gradients")
    if params is not None:
        check_tree(model, params)
    refuse_donated_tree(state.momentum, "the optimizer state")
    moms = state.momentum.parts if isinstance(state.momentum, Params) else ()
    if len(moms) != len(model.parts):
        raise TypeError(f"the optimizer state's momentum has {len(moms)} parts, the model "
                        f"{len(model.parts)}: {FIX_STATE}")
    for part, m, g in zip(model.parts, moms, grads.parts):
        want = g if part.role is Role.STACK else None
        if (m is None) != (want is None) or (m is not None and (
                m.shape != want.shape or m.dtype != want.dtype or m.device != want.device)):
            show = lambda t: "none" if t is None else f"{list(t.shape)} {t.dtype} on {t.device}"
            raise ValueError(f"the optimizer state's momentum of part {part.name} is {show(m)}, "
                             f"this model's is {show(want)}: {FIX_STATE}")
