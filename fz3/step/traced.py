"""``TracedLayers``: each stack's layers run as traced programs, without the autograd engine.

``fz3.step.joint`` traces a layer into a forward, a backward, an inference and a recompute
program. This file decides which layers share them and when they are made:

- Layers share programs as ``fz3.step.layer_groups`` groups them (the same Python state, but
  for plain values their trace never reads: two traces per stack, whatever its depth). A
  layer whose trace does read such a value is traced on its own, and shares the programs of
  an earlier layer whose joint graph reads the same (its printed code: ops and argument
  values; only the trace itself is paid again).
- Programs are traced at a unit's first forward for each input signature (shapes and dtypes
  of h and the tensor extras, the values of the other extras, train or eval mode, and
  the predicate its forward carries, ``fz3.schedule.saveable``: programs cut by another
  than ``save`` keep only what it saves, ``fz3.step.partition``) and kept in the model
  (``ShardedModel.traces``): other step functions on it do not trace again.
- ``compile``: programs compiled by inductor (``fz3.step.inductor``), shared as they are.

A layer's buffers (a router's bias) are its programs' last inputs, each call that layer's
own (``fz3.step.layer_buffers``): their values are never frozen into a program.

A layer that cannot be traced (it reads a tensor's value on the host, branches on data,
writes into an extra, a buffer or a parameter row, makes a tensor from Python values, has
hooks; one that writes into h writes into a copy, ``fz3.step.joint``) runs through autograd
(``fz3.step.engine.AutogradUnit``), with one WARNING (``fz3.comm.say``); ``failed`` says
why.
"""

from __future__ import annotations

import logging
from logging import WARNING
from typing import Sequence

import optree
import torch

from ..comm.say import once, per_rank
from ..schedule.saveable import Keep, Saveable, cuts, name_of, op_name, save
from ..schedule.structure import Role
from ..sharding.binding import Binding
from ..sharding.model import ShardedModel
from ..sharding.parts import Part
from ..sharding import compute
from ..sharding.compute import LayerName
from . import layer_buffers
from .inductor import Kernels, refuse_uncompiled
from .joint import Programs, TraceError, joint_trace, programs
from .layer_groups import Groups, groups, hidden
from .programs import Extras, Layers, Signature

log = logging.getLogger(__name__)


class TracedLayers:
    """The stacks of ``model`` as traced programs (see the module docstring). ``compile``:
    programs compiled by inductor; ``strict``: a program inductor fails on, or a layer that
    cannot be traced, raises ``fz3.CompileError`` (otherwise it runs as Python, or through
    autograd, with a warning)."""

    def __init__(self, model: ShardedModel, *, compile: bool = False, strict: bool = False):
        self.model, self.compile, self.strict = model, compile, strict
        self.kernels = Kernels(strict=strict) if compile else None  # inductor's, by program
        self.groups: dict[int, Groups] = {}  # stack part -> which layers share programs
        self.failed: dict[str, str] = {}  # part name -> why its layers run through autograd
        self.traces = 0  # layers traced so far (0 when every trace was in the model already)
        self._programs: dict[tuple, Programs | None] = {}  # (part, group, signature) ->
        # (part, first, stop, h's shape, stride and dtype, training, extras' key) -> programs
        self._units: dict[tuple, Layers] = {}
        self._extras: dict[tuple, int] = {}  # Extras.consts -> Extras.key
        # (part, signature) -> the first group's graphs: a later group with others compiles again
        self._first: dict[tuple, tuple] = {}
        self._warned: set[int] = set()  # parts reported as compiling per layer
        # parts said to run a predicate's units as recompute, and said to have no op it keeps
        self._warned_keep: set[str] = set()
        self._kept_none: set[str] = set()
        self._shapes: dict[str, list[tuple]] = {}  # part name -> input shapes traced, in order
        for i, part in enumerate(model.parts):
            if part.role is Role.STACK:
                self.groups[i] = groups(model.functions[i], part, self.failed)
        for why in self.failed.values():  # before any step: what no trace can change
            refuse_uncompiled(self.compile and self.strict, why)

    @property
    def compiles(self) -> int:
        """Inductor compilations so far."""
        return 0 if self.kernels is None else self.kernels.compiles

    @property
    def made(self) -> int:
        """Traces and compilations so far: a step that changed it was not a steady one."""
        return self.traces + self.compiles

    def extras(self, extras: tuple, positions: Sequence[int]) -> Extras:
        """``extras`` (a pre or between unit's extra outputs; ``positions``: those with
        gradient) as programs take them. Once per producing unit and step."""
        flat = [optree.tree_flatten(e, none_is_leaf=True) for e in extras]
        tensors, consts, where = [], [], []
        for j, (leaves, spec) in enumerate(flat):
            consts.append(spec)
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    where.append(j)
                    tensors.append(leaf)
                    consts.append((tuple(leaf.shape), leaf.stride(), leaf.dtype))
                else:
                    consts.append(leaf)
        diff = tuple(i for i, j in enumerate(where) if j in positions)
        signature: tuple | None = (diff, tuple(consts))
        try:
            key = self._extras.setdefault(signature, len(self._extras))
        except TypeError:  # an extra that is no tensor and cannot be hashed: not traced
            signature, key = None, -1
        return Extras(tuple(tensors), flat, diff, signature, key)

    def layers(self, part_index: int, first: int, stop: int, h: torch.Tensor,
               extras: Extras, saves: Saveable = save) -> Layers | None:
        """The programs for layers ``[first, stop)`` of a stack on ``h`` and ``extras``, or
        None: they run through autograd. ``saves``: the predicate they are cut by
        (``Layers.saves``). Traced at the first call per signature. On the per-layer path:
        once traced, one dict lookup."""
        unit = (part_index, first, stop, h.shape, h.stride(), h.dtype, self.model.training,
                extras.key, saves)
        known = self._units.get(unit)
        if known is not None:
            return known
        part = self.model.parts[part_index]
        if part.name in self.failed or extras.consts is None:
            if extras.consts is None:
                refuse_uncompiled(self.compile and self.strict, f"{part.name}'s layers are "
                                  f"given an extra that is no tensor and cannot be hashed")
            layers = None
        else:
            signature = Signature(tuple(h.shape), h.stride(), h.dtype, self.model.training,
                                  extras.consts, saves)
            self._say_new_shape(part, signature)
            layers = self._layers(part_index, part, first, stop, h, extras, signature)
        if layers is not None:
            self._units[unit] = layers
        elif saves is not save and part.name not in self._warned_keep:
            self._warned_keep.add(part.name)
            once(log, WARNING, "fz3: %s: %s units run as recompute (its layers run through "
                 "autograd)", part.name, name_of(saves))
        return layers

    def _say_new_shape(self, part: Part, signature: Signature) -> None:
        """Say (a WARNING, per rank: ranks' batches may differ), once per shape, that a stack's
        layers meet inputs of another shape than before (a batch of other shapes; or dtype, or
        extras' shapes and values: "shape" for short): their programs are traced (and
        compiled) again for it, and kept."""
        shape = (signature.shape, signature.dtype, signature.extras)
        seen = self._shapes.setdefault(part.name, [])
        if shape in seen:
            return
        if seen:
            per_rank(log, WARNING, "fz3: %s: layers traced%s again for inputs of another shape "
                     "(h %s %s; %d before, the last %s %s): once per shape, kept for later steps",
                     part.name, " and compiled" if self.compile else "", list(signature.shape),
                     signature.dtype, len(seen), list(seen[-1][0]), seen[-1][1])
        seen.append(shape)

    def _layers(self, part_index: int, part: Part, first: int, stop: int, h: torch.Tensor,
                extras: Extras, signature: tuple) -> Layers | None:
        programs = []
        for layer in range(first, stop):
            got = self._group(part_index, part, layer, h, extras, signature)
            if got is None:
                return None
            programs.append(got)
        dense = torch.empty_like(h, device="meta").stride() == h.stride()  # a copy can take it
        buffers = tuple(layer_buffers.values(self.model.functions[part_index][layer])
                        for layer in range(first, stop))
        return Layers(tuple(programs), signature.saves,
                      self.model.layer_aux, torch.empty(h.shape, device="meta").stride(),
                      h.stride() if dense else None, buffers)

    def _group(self, i: int, part: Part, layer: int, h: torch.Tensor, extras: Extras,
               signature: tuple) -> Programs | None:
        """The programs ``layer`` shares: its ``alike`` group's, traced once with the varying
        values hidden and found to read as the same layer's own trace (two traces per stack),
        or (the hidden trace read one) its ``own`` group's."""
        groups = self.groups[i]
        own = (i, groups.own[layer], signature)
        if groups.varying:
            alike = (i, "alike", groups.alike[layer], signature)
            if alike not in self._programs:
                shared = self._trace(i, part, layer, h, extras, signature, hide=groups.varying)
                if shared is not None:  # and it reads as this layer's own trace does
                    if own not in self._programs:
                        self._programs[own] = self._trace(i, part, layer, h, extras, signature)
                    mine = self._programs[own]
                    shared = shared if mine is not None and mine.graphs is shared.graphs else None
                self._programs[alike] = shared
            if self._programs[alike] is not None:
                return self._programs[alike]
        if own not in self._programs:
            self._programs[own] = self._trace(i, part, layer, h, extras, signature)
        return self._programs[own]

    def _trace(self, i: int, part: Part, layer: int, h: torch.Tensor, extras: Extras,
               signature: tuple, hide: tuple = ()) -> Programs | None:
        """``layer``'s programs (None: it cannot be traced, or, with ``hide``, its trace read
        one of those attributes: the part does not fail for that)."""
        binding = self.model.functions[i][layer]
        name = LayerName(part.path, part.first + layer)
        frozen = part.frozen is not None
        row = torch.empty(part.layout.padded, dtype=self.model.precision.compute,
                          device=self.model.device)
        frozen_row = (torch.empty(part.frozen.padded, dtype=self.model.precision.frozen,
                                  device=self.model.device) if frozen else None)
        inputs = [row, *([frozen_row] if frozen else []), h, *extras.tensors,
                  *layer_buffers.values(binding)]
        # traced once per model: every step function on it (and its copies) reuses them
        key = (binding, part.layout, part.frozen, signature, hide)
        if key not in self.model.traces:
            self.traces += 1
            with hidden(binding, hide):
                self.model.traces[key] = self._programs_of(binding, part, extras, inputs,
                                                           frozen, signature)
        programs = self.model.traces[key]
        if isinstance(programs, TraceError):
            if hide:
                log.debug("fz3: %s's layers trace apart: %s", part.name, programs)
            else:
                self._fail(i, part, f"{name} cannot be traced: {programs}")
            return None
        if self.compile:
            programs = self.kernels.compiled(programs, f"{name} ({part.name})")
            first = self._first.setdefault((i, signature), programs.graphs)
            if first is not programs.graphs and i not in self._warned:
                self._warned.add(i)
                once(log, WARNING, "fz3: the compiled layer function of %s compiled again at "
                     "%s: something its code reads differs per layer (an attribute such as a "
                     "layer index?), so those layers compile on their own. Make the layers "
                     "identical, or pass compile=False", part.name, name)
        return programs

    def _programs_of(self, binding: Binding, part: Part, extras: Extras, inputs: list,
                     frozen: bool, signature: tuple) -> Programs | TraceError:
        """A layer's programs, or why it cannot be traced. Layers whose modules differ (HF's
        ``layer_idx``) but whose joint graphs read alike share programs: only the first is
        split and turned into code."""
        try:  # in the model's mode (a memory plan traces outside a step): dropout or not
            with compute.mode(self.model):
                layer = layer_buffers.layer_function(binding, part, extras.flat,
                                                     layer_buffers.owners(binding))
                joint = joint_trace(layer, inputs, frozen, extras.diff, self.model.layer_aux)
        except TraceError as e:
            return e
        alike = ("joint", joint.code, part.layout, part.frozen, signature)
        if alike not in self.model.traces:
            try:
                self.model.traces[alike] = programs(joint, signature.saves)
            except TraceError as e:
                self.model.traces[alike] = e
        made = self.model.traces[alike]
        if cuts(signature.saves) and not isinstance(made, TraceError) and not made.kept_any:
            self._keeps_none(part, made, signature.saves)
        return made

    def _keeps_none(self, part: Part, made: Programs, saves: Saveable) -> None:
        """A predicate that kept no op of the layer (``Programs.kept_any``): one warning per
        part, naming its ops."""
        if part.name in self._kept_none:
            return
        self._kept_none.add(part.name)
        ran = sorted({op_name(n) for n in made.graphs[0].nodes if n.op == "call_function"})
        if isinstance(saves, Keep):
            said, fix = f"fz3.keep(ops={sorted(saves.ops)})", "name some of its ops in fz3.keep"
        else:
            said, fix = (f"Policy(activations={name_of(saves)})",
                         "check what the predicate asks of a node")
        once(log, WARNING, "fz3: %s keeps no op that %s's layers run (their forward runs %s): "
             "each unit keeps only its input, like recompute; %s", said, part.name, ran, fix)

    def _fail(self, part_index: int, part: Part, why: str) -> None:
        """Its layers run through autograd: all of them, also those of its units found traced
        before. One WARNING, from rank 0 (every rank's layers are alike); with
        ``compile=True, strict=True`` a ``CompileError`` instead."""
        refuse_uncompiled(self.compile and self.strict, why)
        self.failed[part.name] = why
        self._units = {k: v for k, v in self._units.items() if k[0] != part_index}
        once(log, WARNING, "fz3: %s; its layers run through autograd%s", why,
             ", not compiled" if self.compile else "")
