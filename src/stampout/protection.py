"""Which guards only a write to a watched module can invalidate, and the objects per-call checks start from.

A guard is *protected* when every step to its value is an attribute of a watched module reached from the
compiled module itself: its value can change only through a write that bumps EPOCH, so it is checked
after such a write, not on every call. The guards that stay per call (an HF config's attribute, a KV cache
layer) often start with protected steps (`self.layers[3].self_attn.config`): those prefixes are *anchored*,
resolved once per epoch and handed to the generated check, which walks only the rest.
"""

from __future__ import annotations

import types

import torch

from .guards import Guard, Kind
from .sources import MISSING, Anchor, Arg, Attr, CallContext, Item, SlotItem, Source
from .tracking import WriteWatch


def _instance_dict_item(source: Source) -> bool:
    """`obj.__dict__[name]`: written through `obj`'s own `__setattr__`, like an attribute."""
    parent = source.base()
    return isinstance(source, Item) and isinstance(parent, Attr) and parent.attr == "__dict__"


def _path(source: Source) -> list[Source]:
    out = [source]
    while (parent := out[-1].base()) is not None:
        out.append(parent)
    return out[::-1]


def protected(guard: Guard, ctx: CallContext, memo: dict, watch: WriteWatch) -> bool:
    """Whether a write to a watched object is the only way this guard's value can change (watching the
    objects on its path as a side effect)."""
    if guard.kind is Kind.HOOKS and guard.expected != ((), (), (), ()):
        return False  # hooks registered before compile may be removed through old handles
    if guard.kind is Kind.SAME:
        return False
    if guard.kind is Kind.CONST and guard.expected[0] in (list, dict, set):
        return False  # a mutable container: changed in place without any write to its holder
    if guard.kind in (Kind.LEN, Kind.KEYS) and isinstance(guard.source.resolve(ctx, memo), (list, dict, set)):
        return False  # (`self.memory.append(t)`: its length changes, its holder sees no write)
    return protected_path(guard.source, ctx, memo, watch)


def protected_path(source: Source, ctx: CallContext, memo: dict, watch: WriteWatch) -> bool:
    """Whether every step to `source` is an attribute of a watched object reached from the module itself."""
    path = _path(source)
    if not (isinstance(path[0], Arg) and path[0].index == 0):
        return False  # globals, closures, per-call input objects: checked on every call
    if (len(path) > 1 and isinstance(path[1], Attr) and path[1].attr == "__self__"
            and isinstance(path[0].resolve(ctx, memo), types.MethodType)):
        path = path[1:]  # a compiled bound method (`model.forward`): its `__self__` is fixed, the module is the root
    for source in path[:-1]:
        if isinstance(source, Attr) and source.attr == "__dict__":
            continue  # the owner is watched: its __setattr__ writes this dict
        if source.base() is not None and not isinstance(source, Attr) and not _instance_dict_item(source):
            return False  # an item of a container: containers are not watched
        obj = source.resolve(ctx, memo)
        # Only modules: their state changes through __setattr__ and registries that bump the epoch. Other
        # objects (configs, dicts, lists, namespaces) are written in too many ways; their guards run per call.
        if obj is MISSING or not isinstance(obj, torch.nn.Module) or not watch.watch(obj):
            return False
    return True



class Anchors:
    """Protected prefixes of per-call sources, grouped by the object they reached at capture: one anchor per
    object, so a config shared by 80 layers is checked once. `resolve` re-establishes them after a write."""

    def __init__(self, ctx: CallContext, memo: dict, watch: WriteWatch) -> None:
        self.groups: list[list[Source]] = []  # per anchor, the prefixes that reach its object
        self._ctx, self._memo, self._watch = ctx, memo, watch
        self._index: dict[int, int] = {}
        self._of: dict[Source, Source | None] = {}

    def rewrite(self, source: Source) -> Source:
        """`source` starting from the anchor of its deepest protected prefix (its operands too)."""
        if isinstance(source, SlotItem):
            index = self.rewrite(source.index)
            parent = self.rewrite(source.parent)
            return source if parent is source.parent and index is source.index else SlotItem(parent, index)
        path = _path(source)
        for depth in range(len(path) - 1, -1, -1):
            anchor = self._anchor(path[depth])
            if anchor is not None:
                return _replace(source, path[depth], anchor)
        return source

    def _anchor(self, prefix: Source) -> Source | None:
        if prefix in self._of:
            return self._of[prefix]
        anchor = None
        if not isinstance(prefix, Anchor) and protected_path(prefix, self._ctx, self._memo, self._watch):
            obj = prefix.resolve(self._ctx, self._memo)
            index = self._index.setdefault(id(obj), len(self.groups))
            if index == len(self.groups):
                self.groups.append([])
            self.groups[index].append(prefix)
            anchor = Anchor(index, prefix.name())
        self._of[prefix] = anchor
        return anchor

    def resolve(self, ctx: CallContext, memo: dict) -> tuple | None:
        """Each anchor's object now; None when the prefixes of one anchor no longer reach one object (a write
        moved one of them: the grouping the check was generated for no longer holds)."""
        out = []
        for prefixes in self.groups:
            obj = prefixes[0].resolve(ctx, memo)
            if any(p.resolve(ctx, memo) is not obj for p in prefixes[1:]):
                return None
            out.append(obj)
        return tuple(out)

    def holders(self, ctx: CallContext, memo: dict) -> list[torch.nn.Module]:
        """The modules whose `__dict__` holds an anchored object (their dicts are version-checked per call)."""
        out = []
        for prefixes in self.groups:
            for prefix in prefixes:
                parent = prefix.base()
                if isinstance(prefix, Attr) and parent is not None:
                    obj = parent.resolve(ctx, memo)
                    if isinstance(obj, torch.nn.Module) and prefix.attr in obj.__dict__:
                        out.append(obj)
        return out


def _replace(source: Source, prefix: Source, new: Source) -> Source:
    if source == prefix:
        return new
    parent = source.base()
    return source.with_parent(_replace(parent, prefix, new))


def anchored(guards: list[Guard], anchors: Anchors) -> list[Guard]:
    """`guards` on anchored sources, each distinct check once."""
    out: list[Guard] = []
    seen: set = set()
    for guard in guards:
        source = anchors.rewrite(guard.source)
        expected = anchors.rewrite(guard.expected) if guard.kind is Kind.SAME else guard.expected
        if guard.kind is Kind.SAME and source == expected:
            continue  # both sides reach one anchor: the same object while the anchors hold
        try:
            key = (source, guard.kind, expected)
            if key in seen:
                continue
            seen.add(key)
        except TypeError:  # an unhashable expected value: kept as it is
            pass
        out.append(guard if source is guard.source and expected is guard.expected
                   else Guard(source, guard.kind, expected, guard.where))
    return out
