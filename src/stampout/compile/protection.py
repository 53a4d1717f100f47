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

from ..guards.guard import Guard, Kind
from ..sources import MISSING, Anchor, Arg, Attr, CallContext, Item, SlotItem, Source
from ..watch.tracking import WriteWatch


def _instance_dict_item(source: Source) -> bool:
    """`obj.__dict__[name]`: written through `obj`'s own `__setattr__`, like an attribute."""
    parent = source.base()
    return isinstance(source, Item) and isinstance(parent, Attr) and parent.attr == "__dict__"


class Protection:
    """Which guards and sources only a write to a watched object can invalidate, in one call context (watching
    the objects on their paths as a side effect). Each prefix of a path is decided once: the thousands of
    guards of a deep model share their paths' prefixes (`self.layers[3].attn`), and walking every path from
    the root cost as much as the capture itself."""

    def __init__(self, ctx: CallContext, memo: dict, watch: WriteWatch) -> None:
        self.ctx, self.memo, self.watch = ctx, memo, watch
        self._prefix: dict[Source, bool] = {}  # a path's step: it and every step before it are watched modules

    def guard(self, guard: Guard) -> bool:
        """Whether a write to a watched object is the only way this guard's value can change."""
        if guard.kind is Kind.HOOKS and guard.expected != ((), (), (), ()):
            return False  # hooks registered before compile may be removed through old handles
        if guard.kind is Kind.SAME:
            return False
        if guard.kind is Kind.CONST and guard.expected[0] in (list, dict, set):
            return False  # a mutable container: changed in place without any write to its holder
        if guard.kind in (Kind.LEN, Kind.KEYS) and isinstance(guard.source.resolve(self.ctx, self.memo),
                                                               (list, dict, set)):
            return False  # (`self.memory.append(t)`: its length changes, its holder sees no write)
        if guard.kind is Kind.TYPE and not self._step_watched(guard.source):
            return False  # (`self.cfg.__class__ = Other`: written through the config's own class, not its holder)
        return self.path(guard.source)

    def path(self, source: Source) -> bool:
        """Whether every step to `source` is an attribute of a watched object reached from the module itself
        (globals, closures, per-call input objects: checked on every call)."""
        parent = source.base()
        if parent is None:
            return _is_module_arg(source)
        if self._self_of_method(source):
            return True  # a compiled bound method's `__self__` is fixed: the module is the root
        return self._steps_watched(parent)

    def _steps_watched(self, source: Source) -> bool:
        """`source` and every step before it are watched modules (or their `__dict__`s)."""
        try:
            return self._prefix[source]
        except KeyError:
            pass
        parent = source.base()
        if parent is None:
            ok = _is_module_arg(source) and self._step_watched(source)
        elif self._self_of_method(source):
            ok = self._step_watched(source)
        else:
            ok = self._steps_watched(parent) and self._step_watched(source)
        self._prefix[source] = ok
        return ok

    def _self_of_method(self, source: Source) -> bool:
        parent = source.base()
        return (isinstance(source, Attr) and source.attr == "__self__" and _is_module_arg(parent)
                and isinstance(parent.resolve(self.ctx, self.memo), types.MethodType))

    def _step_watched(self, source: Source) -> bool:
        if isinstance(source, Attr) and source.attr == "__dict__":
            return True  # the owner is watched: its __setattr__ writes this dict
        if source.base() is not None and not isinstance(source, Attr) and not _instance_dict_item(source):
            return False  # an item of a container: containers are not watched
        obj = source.resolve(self.ctx, self.memo)
        # Only modules: their state changes through __setattr__ and registries that bump the epoch. Other
        # objects (configs, dicts, lists, namespaces) are written in too many ways; their guards run per call.
        return obj is not MISSING and isinstance(obj, torch.nn.Module) and self.watch.watch(obj)


def _is_module_arg(source: Source | None) -> bool:
    return isinstance(source, Arg) and source.index == 0


class Anchors:
    """Protected prefixes of per-call sources, grouped by the object they reached at capture: one anchor per
    object, so a config shared by 80 layers is checked once. `resolve` re-establishes them after a write."""

    def __init__(self, protection: Protection) -> None:
        self.groups: list[list[Source]] = []  # per anchor, the prefixes that reach its object
        self._protection = protection
        self._index: dict[int, int] = {}
        self._of: dict[Source, Source | None] = {}

    def rewrite(self, source: Source) -> Source:
        """`source` starting from the anchor of its deepest protected prefix, and so the operands of every step
        (`cache.layers[<self.layers[3].attn.layer_idx>].keys`: the index is an anchor, not a walk from the root)."""
        if isinstance(source, SlotItem):
            index = self.rewrite(source.index)
            parent = self.rewrite(source.parent)
            return source if parent is source.parent and index is source.index else SlotItem(parent, index)
        anchor = self._anchor(source)
        if anchor is not None:
            return anchor
        parent = source.base()
        if parent is None:
            return source
        new = self.rewrite(parent)
        return source if new is parent else source.with_parent(new)

    def _anchor(self, prefix: Source) -> Source | None:
        if prefix in self._of:
            return self._of[prefix]
        anchor = None
        protection = self._protection
        if not isinstance(prefix, Anchor) and protection.path(prefix):
            obj = prefix.resolve(protection.ctx, protection.memo)
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
