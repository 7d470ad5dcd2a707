"""The skeleton's parameters: placeholders that no function can read.

fz3 keeps a skeleton copy of the module and, for each call of a part's function, puts that
part's gathered parameters into it (``fz3/sharding/binding.py``). Every other parameter stays
a placeholder. Meta tensors were the placeholders until round 4, and a meta tensor is not
safe: CPU kernels such as ``linear`` and ``matmul`` accept a meta operand and return
uninitialised memory (torch 2.13), so a head registered before the layers and read by
``post`` (litgpt's ``GPT``) gave a wrong loss with no error.

``Unreachable`` is a meta-shaped tensor subclass whose every op that would read its values
raises ``PartReadError``, naming the parameter and the part it belongs to. Reading its
``.shape``, ``.dtype``, ``.device`` or ``.requires_grad`` is not a read (no op runs), nor
are views and the ops that only make another tensor of its shape (``detach``, ``alias``,
``zeros_like``...: ``module.state_dict()`` detaches every parameter); what they make is
unreachable too, so no value derived from a placeholder ever meets a real tensor. An op
that writes into a placeholder (an initialiser: ``normal_``, ``copy_``; Hugging Face's
``_init_weights`` runs them when ``weights=`` makes meta buffers real) does nothing, as it
did on a meta tensor: nothing it wrote could be read. A
placeholder is made once, in ``fz3.shard``; the per-call path never touches one.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

aten = torch.ops.aten

# ops that make a tensor from the placeholder's metadata only, never its values
_METADATA_ONLY = frozenset({
    aten.detach.default, aten.alias.default, aten.empty_like.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.new_zeros.default, aten.new_ones.default,
    aten.zeros_like.default, aten.ones_like.default,
})


class PartReadError(ValueError):
    """A function read a parameter that is not among its parts' (placement by registration
    or ``assign=`` put it elsewhere). ``parameter`` and ``part`` name it and where it is;
    ``function`` (the reader: ``pre``, ``post``, ``layer blocks.3``...) is filled in by the
    caller that knows it (``fz3.sharding.compute.call``)."""

    def __init__(self, parameter: str, part: str, function: str | None = None,
                 reader_part: str | None = None):
        self.parameter, self.part = parameter, part
        self.function, self.reader_part = function, reader_part
        super().__init__(self._message())

    def _message(self) -> str:
        who = self.function or "a function of the model"
        fix = (f"assign={{{self.parameter!r}: {self.reader_part!r}}} to fz3.shard"
               if self.reader_part in ("pre", "post") or (self.reader_part or "").startswith(
                   "between.")
               else "assign= to move it to the reader's part, or pass its value from pre as "
                    "an extra (layers of a stack read only their own parameters)")
        return (f"{who} read parameter {self.parameter!r}, which fz3.shard placed in part "
                f"{self.part!r}: a function may read only its own part's parameters (and tied "
                f"ones). Pass example=<a batch> to fz3.shard to place parameters by what each "
                f"function reads, or {fix}")

    def named(self, function: str, reader_part: str | None) -> "PartReadError":
        """The same error naming the function that read the parameter and its part."""
        return PartReadError(self.parameter, self.part, function, reader_part)


class Unreachable(torch.Tensor):
    """A placeholder of ``parameter``'s shape and dtype on the meta device, in part ``part``;
    every op that reads its values raises ``PartReadError``."""

    parameter: str
    part: str

    @staticmethod
    def __new__(cls, like: torch.Tensor, parameter: str, part: str) -> "Unreachable":
        out = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device="meta",
            requires_grad=like.requires_grad)
        out.parameter, out.part = parameter, part
        return out

    def __repr__(self) -> str:  # no op may run to print it
        return (f"Unreachable({self.parameter!r}, part={self.part!r}, shape={list(self.shape)}, "
                f"dtype={self.dtype})")

    def __deepcopy__(self, memo: dict) -> "Unreachable":
        return Unreachable(self, self.parameter, self.part)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        leaves = optree.tree_leaves((args, kwargs or {}))
        first = next(t for t in leaves if isinstance(t, Unreachable))
        if _writes_first(func) and isinstance(args[0], Unreachable):
            return args[0]  # an initialiser (HF's _init_weights): nothing to write, as on meta
        if func not in _METADATA_ONLY and not func.is_view:
            raise PartReadError(first.parameter, first.part)
        plain = optree.tree_map(
            lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            if isinstance(t, Unreachable) else t, (args, kwargs or {}))
        out = func(*plain[0], **plain[1])
        return Unreachable(out, first.parameter, first.part)


def _writes_first(func: Any) -> bool:
    """Whether ``func`` writes into its first argument (``normal_``, ``copy_``, ``fill_``...)."""
    arguments = func._schema.arguments
    alias = arguments[0].alias_info if arguments else None
    return alias is not None and alias.is_write


def unreachable(module: torch.nn.Module, part_of: dict[str, str]) -> None:
    """Replace every parameter of ``module`` (fz3's own skeleton, all on the meta device) by
    an ``Unreachable`` naming it and its part (``part_of``: every name -> part name), in place.
    A tied parameter stays one placeholder under both names."""
    made: dict[int, Unreachable] = {}
    for name, p in list(module.named_parameters(remove_duplicate=False)):
        if id(p) not in made:
            made[id(p)] = Unreachable(p, name, part_of.get(name, "?"))
        owner_path, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_path)
        owner._parameters[attr] = made[id(p)]
