"""A nested region call stamped out (not traced) inside a region trace: the entry's guards, rebased from the
nested call's arguments, closures and globals onto the enclosing trace's sources.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..guards.guard import Guard, Kind, is_constant
from ..sources import Absolute, Arg, Attr, Closure, FnAttr, Global, Item, Source
from ..torch_internals import FakeTensor
from ..trace.tensormeta import TensorMeta
from ..watch.tracking import Watch
from .cache import ArgInput


class FrameNested:
    """The nested-entry part of a RegionFrame: its attributes are set in `_begin_nested`."""

    # the host's (RegionFrame), read here
    sources: dict[int, Source]
    watch: Watch
    guard: Callable[..., None]
    _name: Callable[..., bool]
    _written: set[tuple[int, str]]
    mark_ineligible: Callable[..., None]

    def _begin_nested(self) -> None:
        # Per (entry, region function) imported once: the entry's guards on class, global and closure facts,
        # which rebase to the same guards on every stamped call; later calls import only the per-call ones.
        self._facts_imported: dict[tuple[int, int], tuple[Any, list[Guard]]] = {}

    def import_entry(self, entry: Any, leaves: list[Any], fn: Callable, lifted_values: list[Any]) -> None:
        """Take over the guards of a nested entry stamped out during this trace, rebased onto our sources."""
        unnamed: set[int] = set()

        def translate(root: Source) -> Source | None:
            if isinstance(root, Arg):
                source = self.sources.get(id(leaves[root.index]))
                if source is None:
                    unnamed.add(root.index)
                return source
            if isinstance(root, Closure):
                return Attr(Item(Attr(Absolute(fn, fn.__qualname__), "__closure__"), root.index), "cell_contents")
            if isinstance(root, Global):
                return Item(Absolute(fn.__globals__, f"{fn.__module__}.globals"), root.var)
            if isinstance(root, FnAttr):
                return Attr(Absolute(fn, fn.__qualname__), root.attr)
            return root

        key = (id(entry), id(fn))
        imported = self._facts_imported.get(key)
        if imported is None:
            guards = entry.guards
            self._facts_imported[key] = (fn, [g for g in entry.guards if _reads_arguments(g)])  # fn kept alive
        else:
            guards = imported[1]
        # Attributes this trace stored before the call (`layer.cache = h; layer(x)`): the entry read them, but here
        # they hold values this trace computed from what it guards, stored again by every call before it reads
        # them: not state to guard (a tensor of its own, a fake, would fail every call's check). What the entry read
        # deeper in an object stored there (`layer.cfg = CFG`, then `self.cfg.scale`) stays guarded.
        written = {Attr(self.sources[owner], name) for owner, name in self._written if owner in self.sources}
        for guard in guards:
            source = guard.source.rebase(translate)
            expected = guard.expected.rebase(translate) if guard.kind is Kind.SAME else guard.expected
            if guard.kind is Kind.DISTINCT:  # (an object this frame cannot name is one the traced code made)
                expected = tuple(s for s in (e.rebase(translate) for e in guard.expected) if s is not None)
            if written and source is not None and (source in written or guard.kind is Kind.TENSOR and isinstance(
                    guard.expected, TensorMeta) and guard.expected.cls is FakeTensor and _within(source, written)):
                continue
            if source is None or guard.kind is Kind.SAME and expected is None:  # (NAMESPACE: expected None)
                # An argument this frame cannot name is an object the traced code made itself (its state
                # comes from what this frame read); anything else would be unguarded: refuse.
                if any(not _made_here(leaves[i], self.watch) for i in unnamed):
                    self.mark_ineligible(f"calls region {entry.region} with an argument it cannot name")
                    return
                continue
            self.guard(source, guard.kind, expected, guard.where)
        for spec, value in zip(entry.lifted, lifted_values):
            if not isinstance(spec, ArgInput) and isinstance(value, torch.Tensor):
                source = spec.source.rebase(translate) if spec.source is not None else None
                if source is not None:
                    self._name(value, source)


def _within(source: Source | None, roots: set[Source]) -> bool:
    while source is not None:
        if source in roots:
            return True
        source = source.base()
    return False


def _rooted_in_arguments(source: Source) -> bool:
    if any(_rooted_in_arguments(s) for s in source.operands()):
        return True
    parent = source.base()
    return isinstance(source, Arg) if parent is None else _rooted_in_arguments(parent)


def _reads_arguments(guard: Guard) -> bool:
    """Whether a guard's source (or, for SAME and DISTINCT, the other side) starts from a call argument."""
    return (_rooted_in_arguments(guard.source) or guard.kind is Kind.SAME and _rooted_in_arguments(guard.expected)
            or guard.kind is Kind.DISTINCT and any(map(_rooted_in_arguments, guard.expected)))


def _made_here(obj: Any, watch: Watch) -> bool:
    return isinstance(obj, torch.Tensor) or is_constant(obj) or obj not in watch or id(obj) in watch.arguments
