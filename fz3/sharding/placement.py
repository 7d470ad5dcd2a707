"""Which function reads which parameter: ``fz3.shard(..., example=batch)`` places parameters
by use.

Parts follow registration order unless told otherwise (``fz3/sharding/parts.py``), and the
order a module registers its submodules in says nothing about who reads them: litgpt's
``GPT`` registers ``lm_head`` before ``transformer``, so the head landed in ``pre`` while
``post`` reads it. Given an example batch, ``reads`` runs the model's functions once, in
compute order (``pre``, every layer of each stack through ``call_layer``, each ``between``,
``post``), on fake tensors (``FakeTensorMode``: shapes and dtypes only, no memory, no math)
and records which parameters each one's ops take as arguments. Reading ``.shape``,
``.dtype`` or ``.device`` runs no op, so it is not a read.

Cost: one pass of the model's Python with fake tensors, at ``fz3.shard``, on every rank
(each rank places its own copy the same way: ``check_same_on_all_ranks`` then compares
the parts). Nothing is recorded for later steps: at every call, a function that reads a
parameter outside its part raises (``fz3/sharding/unreachable.py``), which is also what
catches a read that the example's shapes did not take (a branch on data).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import optree
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from .binding import BoundFunction
from .checks import layer_children

log = logging.getLogger("fz3")

# a reader: "pre", "between.i", "post", or "layer <path>.<name>"
Reads = dict[str, set[str]]  # parameter name -> the functions that read it


class Move(NamedTuple):
    """A parameter placed by use (``example=``) in another part than its registration's."""

    name: str
    registered: str  # the part registration order gives ("pre", "post", "between.0")
    read_by: str  # the part(s) whose functions read it ("post"; "pre+post": a shared part)


def assigned(name: str, assign: Mapping[str, str]) -> str | None:
    """The longest ``assign`` key that is ``name`` or a prefix of it, or None."""
    return max((k for k in assign if name == k or name.startswith(k + ".")), key=len,
               default=None)


def homes_by_use(names: Sequence[str], used: Mapping[str, set[str]] | None,
                 assign: Mapping[str, str]) -> set[str]:
    """The parts whose functions read a parameter outside the stacks (``used``), or an empty
    set: not placed by use (no example, nobody reads it, or ``assign=`` names it). A layer
    that reads it is refused here, by name."""
    if not used or any(assigned(n, assign) is not None for n in names):
        return set()
    readers = set().union(*(used.get(n, ()) for n in names))
    layers = sorted(r for r in readers if r.startswith("layer "))
    if layers:
        raise ValueError(f"{layers[0]} reads parameter {names[0]!r}, which is outside the "
                         f"layers (fz3.shard(example=...) ran it): a layer reads only its own "
                         f"parameters; compute from it in pre and pass the result to every layer "
                         f"as an extra (pre returns (h, *extra)), or make it part of each layer")
    return readers


class PlacementError(ValueError):
    """``fz3.shard(example=...)`` could not run a function on fake tensors, or found a read
    no part can hold (a layer reading a parameter outside its stack)."""


def reads(module: nn.Module, paths: Sequence[str], pre: Callable, post: Callable,
          between: Sequence[Callable | None], call_layer: Callable, example: Any,
          layer_aux: bool, device: torch.device) -> Reads:
    """Parameter name -> the functions that read it, running each once on fake tensors of
    ``example`` (see the module docstring). Every name of a tied parameter is listed."""
    names_of: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # a plain tensor attribute is read too
    with mode:
        fakes = {id(p): torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=device,
                                            requires_grad=p.requires_grad)
                 for p in module.parameters()}
    bound = {"m." + n: fakes[i] for i, names in names_of.items() for n in names}
    bound.update({"m." + n: _fake(mode, b, device) for n, b in module.named_buffers()})
    by_fake = {id(fakes[i]): names for i, names in names_of.items()}
    batch = optree.tree_map(lambda t: _fake(mode, t, device) if isinstance(t, torch.Tensor)
                            else t, example)
    found: Reads = {}
    record = _Recorder(by_fake, found)

    def run(reader: str, fn: Callable, *args: Any) -> Any:
        record.reader = reader
        try:
            with mode, record, quiet_fake_tensor_log():
                return functional_call(BoundFunction(fn, module), bound, args, tie_weights=False)
        except PlacementError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the user's function is named
            raise PlacementError(
                f"fz3.shard(example=...) ran {reader} on fake tensors of the example batch to "
                f"see which parameters it reads, and it failed: {type(e).__name__}: "
                f"{str(e)[:400]}. Pass a batch the model accepts, or drop example= and place "
                f"parameters with assign=") from e

    out = _tuple(run("pre", pre, batch))
    h, extras = out[0], out[1:]
    gaps = list(between) + [None] * (len(paths) - 1 - len(between))
    auxes = []
    for i, path in enumerate(paths):
        h, stack_aux = _layers(run, module, path, call_layer, h, extras, layer_aux)
        if layer_aux:
            with mode:
                auxes.append(torch.stack(stack_aux))
        if i < len(gaps) and gaps[i] is not None:
            got = _tuple(run(f"between.{i}", gaps[i], h, batch))
            h, extras = got[0], got[1:] or extras
    run("post", post, h, batch, *((tuple(auxes),) if layer_aux else ()))
    return found


def _layers(run: Callable, module: nn.Module, path: str, call_layer: Callable, h: Any,
            extras: tuple, layer_aux: bool) -> tuple[Any, list]:
    """Every layer of the container at ``path`` through ``run``: ``(h, their aux outputs)``."""
    stack_aux = []
    for key, _ in layer_children(module, path):
        def layer_fn(m, h, *extras, _key=key):
            return call_layer(dict(layer_children(m, path))[_key], h, *extras)
        try:
            got = run(f"layer {path}.{key}", layer_fn, h, *extras)
        except PlacementError as e:
            if layer_aux:  # the loss needs its aux's shape
                raise
            # a kernel whose fake version refuses what the real one takes (``_grouped_mm``
            # in fp32 on the CPU): h goes on as it came (layers keep h's shape), and what
            # the layer reads is checked at each call instead
            log.info("%s; h goes on unchanged, and its reads are checked at each call", e)
            continue
        h = got[0] if layer_aux else got
        if layer_aux:
            stack_aux.append(got[1])
    return h, stack_aux


def _tuple(out: Any) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _fake(mode: FakeTensorMode, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.is_meta:
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return mode.from_tensor(t)


@contextlib.contextmanager
def quiet_fake_tensor_log() -> Iterator[None]:
    """torch's fake-tensor logger above ERROR while inside: it prints an op's whole traceback
    when a fake kernel refuses its inputs (``_grouped_mm`` in fp32), which fz3 then reports
    in one line of its own. Nothing else is silenced."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class _Recorder(TorchDispatchMode):
    """Every op's tensor arguments that are fake parameters: the current reader reads them."""

    def __init__(self, by_fake: Mapping[int, list[str]], found: Reads):
        super().__init__()
        self.by_fake, self.found, self.reader = by_fake, found, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in optree.tree_leaves((args, kwargs or {})):
            names = self.by_fake.get(id(t)) if isinstance(t, torch.Tensor) else None
            if names:
                for n in names:
                    self.found.setdefault(n, set()).add(self.reader)
        return func(*args, **(kwargs or {}))
