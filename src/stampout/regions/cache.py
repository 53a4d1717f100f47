"""Reuse entries and the region cache: entries per region, subgraphs, structural dedup."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..guards.guard import Guard, const_key, is_constant, tensor_meta
from ..trace.shapes import size_key
from ..trace.structure import Template
from ..trace.tensormeta import OutputMeta
from .fingerprint import Fingerprint, StateKey


@dataclass(frozen=True)
class ArgInput:
    """A subgraph input that is the call's own flat input leaf `index`."""

    index: int


@dataclass(frozen=True)
class SourceInput:
    """A subgraph input captured from a source relative to the call (a parameter, buffer, tensor attribute,
    closure or global); None when the trace could not name it (the entry is then ineligible)."""

    source: Any


@dataclass(frozen=True)
class SymbolInput:
    """A subgraph input that is a symbolic size of the capture (a bound symbol), passed as an int."""

    symbol: Any


LiftedInput = ArgInput | SourceInput | SymbolInput


class Output(enum.Enum):
    """How a stamped call gets the value of one hole of the output template: the kind leading a row
    `(kind, index, *view)` of `ReuseEntry.outputs`."""

    OUT = "out"  # subgraph output `index`
    IN = "in"  # subgraph input `index`: the call's operand itself
    VIEW = "view"  # as_strided(subgraph output `index`, size, stride, storage offset): a view the caller takes
    IN_VIEW = "inview"  # as_strided(operand `index`, size, stride, storage offset relative to the operand's)


class Store(enum.Enum):
    """What an attribute store a stamped call repeats stores: the kind leading `(kind, value)` in
    `ReuseEntry.stores`."""

    CONST = "const"  # `value` itself
    HOLE = "hole"  # the value of the output template's hole `value`
    OPERAND = "operand"  # subgraph input `value`
    MISSING = "missing"  # the attribute deleted


@dataclass(eq=False, kw_only=True)
class ReuseEntry:
    """What a traced region call leaves behind so later equivalent calls can be stamped out."""

    region: str
    fingerprint: Fingerprint
    guards: list[Guard]
    check: Callable[[list[Any], Any], bool]
    lifted: list[LiftedInput]  # how each subgraph placeholder is obtained
    subgraph: str
    gm: fx.GraphModule
    outputs: list[tuple]  # per template hole: (Output kind, index, *view)
    template: Template
    out_meta: dict[tuple, list[OutputMeta]]  # requires_grad pattern of the inputs -> per output; more patterns
    # added as calls need them
    n_outputs: int
    rg_pattern: tuple | None = None  # set when the trace read `requires_grad`: then it must match
    operand_aliases: tuple[int, ...] = ()  # which subgraph inputs were the same tensor (see aliases_of)
    call_site: str = ""
    generation: int = 0  # which capture made it (a compiled function's captures share one cache)
    leaves: list | None = None  # the traced call's input leaves, in a symbolic capture (see RegionCache.rekey)
    stores: tuple = ()  # attribute stores a stamped call repeats: (target source, name, (Store kind, value))


@dataclass
class RegionCache:
    """Every reuse entry and subgraph of one capture (or of one `stampout.compile`d function)."""

    entries: dict[Any, list[ReuseEntry]] = field(default_factory=dict)  # code -> entries
    by_fingerprint: dict[tuple, list[ReuseEntry]] = field(default_factory=dict)  # (code, fp) -> entries
    hashed: dict[tuple, ReuseEntry] = field(default_factory=dict)  # (code, user hash) -> entry
    subgraphs: dict[str, fx.GraphModule] = field(default_factory=dict)
    by_structure: dict[tuple, str] = field(default_factory=dict)
    generation: int = 0

    def add(self, code: Any, entry: ReuseEntry) -> None:
        self.entries.setdefault(code, []).append(entry)
        self.by_fingerprint.setdefault((code, entry.fingerprint), []).append(entry)

    def rekey(self, code: Any, key_of: Callable[[list], tuple]) -> None:
        """Fingerprints of symbolic sizes are the ShapeEnv's simplification when they were made; a guard since
        may have simplified them further (a symbol specialized, two found equal). Make the region's entries'
        fingerprints again, so later calls with the same sizes find them."""
        for entry in self.entries.get(code, ()):
            if entry.leaves is None:
                continue
            fp = entry.fingerprint
            new = fp._replace(leaves=key_of(entry.leaves))
            if new != fp:
                self.by_fingerprint[(code, fp)].remove(entry)
                entry.fingerprint = new
                self.by_fingerprint.setdefault((code, new), []).append(entry)

    def evict(self, code: Any, entry: ReuseEntry) -> None:
        self.entries[code].remove(entry)
        self.by_fingerprint[(code, entry.fingerprint)].remove(entry)
        self.hashed = {k: v for k, v in self.hashed.items() if v is not entry}

    def register(self, gm: fx.GraphModule, state: StateKey) -> tuple[str, fx.GraphModule, bool]:
        """Name for a traced subgraph: an existing identical one (deduped=True) or a new one.

        `state` (grad mode, autocast, default dtype) is part of the key: AOTAutograd keys its traces of a
        subgraph by name, and one name used with and without grad breaks its backward."""
        key = (state, structure_key(gm))
        name = self.by_structure.get(key)
        if name is not None:
            return name, self.subgraphs[name], True
        name = f"subgraph_{len(self.subgraphs)}"
        self.subgraphs[name] = gm
        self.by_structure[key] = name
        return name, gm, False


def _arg_key(value: Any, index: dict[fx.Node, int]) -> Any:
    if isinstance(value, fx.Node):
        return ("node", index[value])
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_arg_key(v, index) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _arg_key(v, index)) for k, v in value.items()))
    if isinstance(value, slice):
        return (slice, _arg_key((value.start, value.stop, value.step), index))
    if is_constant(value):
        return const_key(value)
    return ("obj", type(value), repr(value))


def structure_key(gm: fx.GraphModule) -> tuple:
    """Equal for graphs with the same nodes, targets, constants and placeholder metadata."""
    index: dict[fx.Node, int] = {}
    items = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        meta = None
        if node.op == "placeholder":
            val = node.meta.get("val")
            # requires_grad is left out: like reuse, dedup holds across which inputs require grad
            if isinstance(val, torch.Tensor):
                meta = tensor_meta(val, requires_grad=False)._replace(cls=None)
            elif val is not None:
                meta = ("size", size_key(val))
        target = node.target if isinstance(node.target, str) else (id(node.target), str(node.target))
        if node.op == "get_attr" and not isinstance(getattr(gm, node.target, None), fx.GraphModule):
            target = ("constant", id(getattr(gm, node.target)))
        items.append((node.op, target, _arg_key(node.args, index), _arg_key(node.kwargs, index), meta))
    return tuple(items)
