"""What ``fz3.shard`` says of a model it cannot run by itself, Hugging Face or not: the layer
containers it can see (``ModuleList``, ``Sequential``, ``ModuleDict``: path, count, whether
the children are structurally identical, whether each can be called ``layer(h, *extras)``)
and the arguments that would run it. And the one refusal of a given container whose children
cannot be called (each child a ``ModuleList``, as in x-transformers) without ``call_layer=``.
Local: no collective."""

from __future__ import annotations

from typing import NamedTuple, Sequence

from torch import nn

from .checks import resolve_layers

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
README = "README, 'A model without a built-in adapter'"
SHOWN = 4  # candidates named in a message, the most parameters first


class Candidate(NamedTuple):
    path: str  # dotted path in the model
    kind: str  # ModuleList, Sequential or ModuleDict
    count: int  # children
    children: str  # their class names, in order, runs collapsed ("12 x Block")
    identical: bool  # every child has the same class and parameter names, shapes and dtypes
    callable: bool  # every child has a forward of its own (a ModuleList child has none)
    params: int  # parameters inside it (to rank candidates)


def candidates(module: nn.Module) -> list[Candidate]:
    """The containers of two or more children in ``module``, outermost only (a container
    inside another's child is part of that layer), the most parameters first."""
    found: list[Candidate] = []
    taken: list[str] = []
    for path, c in module.named_modules():
        if not isinstance(c, CONTAINERS) or len(c) < 2 or path == "" or \
                any(path.startswith(t + ".") for t in taken):
            continue
        taken.append(path)
        children = list(c.children())
        sig = [_signature(child) for child in children]
        found.append(Candidate(path, type(c).__name__, len(children), _names(children),
                               all(s == sig[0] for s in sig),
                               all(has_forward(child) for child in children),
                               sum(p.numel() for p in c.parameters())))
    return sorted(found, key=lambda x: -x.params)


def has_forward(module: nn.Module) -> bool:
    """Whether ``module(h, ...)`` runs: its class defines ``forward`` (a ``ModuleList`` or
    ``ModuleDict`` does not)."""
    return type(module).forward is not nn.Module.forward


def no_adapter_message(module: nn.Module, why: str | None = None) -> str:
    """The refusal of a model with no layers/pre/post and no built-in adapter: the candidate
    containers, ``layers=``/``pre=``/``post=``, ``call_layer=`` (named for a candidate whose
    children cannot be called ``layer(h, *extras)``), ``assign=`` and the README section."""
    found = candidates(module)
    shown = "; ".join(_describe(c) for c in found[:SHOWN])
    more = f" (and {len(found) - SHOWN} more)" if len(found) > SHOWN else ""
    top = found[0].path if found else "<dotted path of the container of blocks>"
    return (f"fz3.shard got no layers=/pre=/post= and has no built-in adapter for "
            f"{type(module).__name__}{f' ({why})' if why else ''}; layer containers in it: "
            f"{shown or 'none (no ModuleList, Sequential or ModuleDict of 2 or more children)'}"
            f"{more}; pass layers='{top}' (a ModuleList, Sequential or ModuleDict, or a list "
            f"of paths), pre=(m, batch) -> h or (h, *extras), post=(m, h, batch) -> loss; "
            f"call_layer=(layer, h, *extras) -> h where a layer is not called layer(h, "
            f"*extras) (it takes keyword arguments, returns a tuple, or has no forward of its "
            f"own); assign={{'<parameter name prefix>': 'pre' | 'post'}} for a parameter "
            f"registered on one side of the layers and read by the function on the other "
            f"({README}, shows the pattern)")


def check_callable(module: nn.Module, paths: Sequence[str], call_layer) -> None:
    """Without ``call_layer``, a TypeError naming it when a container's children have no
    ``forward`` of their own (each child a ``ModuleList``): fz3 would call ``layer(h,
    *extras)`` and torch would raise from inside the step. A path that does not resolve is
    left to ``fz3.shard``'s own refusal (``fz3.sharding.checks.resolve_layers``)."""
    if call_layer is not None:
        return
    for path in paths:
        try:
            stack = resolve_layers(module, path)
        except (TypeError, ValueError):  # fz3.shard names it, after its other checks
            continue
        bad = next((child for child in stack.children() if not has_forward(child)), None)
        if bad is not None:
            raise TypeError(f"layers={path!r} holds {type(bad).__name__}s, which have no "
                            f"forward of their own, and fz3.shard got no call_layer=: pass "
                            f"call_layer=(layer, h, *extras) -> h that runs one child (e.g. "
                            f"each of its modules in turn) as the model's own forward does "
                            f"({README})")


def _describe(c: Candidate) -> str:
    alike = "all alike" if c.identical else "not all alike: one stack per run of alike ones"
    call = "" if c.callable else ", no forward of their own: needs call_layer="
    return f"{c.path!r} ({c.kind} of {c.children}, {alike}{call})"


def _signature(module: nn.Module) -> tuple:
    return (type(module), tuple((n, tuple(p.shape), p.dtype)
                                for n, p in module.named_parameters()))


def _names(children: list[nn.Module]) -> str:
    runs: list[list] = []
    for child in children:
        name = type(child).__name__
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return ", ".join(f"{n} x {name}" for name, n in runs)
