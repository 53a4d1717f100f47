"""An entry's per-call check, memoized on the objects it walks: its reads of plain instance state vouched for by
one C++ check of identities, classes and dict versions.

# Note: instance facts
The per-call check of a decode step reads, for each of 80 cache layers, `cache.layers[i]`, its class, then
`is_initialized`, `device`, `cumulative_length`, `keys` and `values`: six Python reads a layer, every call,
to find the same objects as the call before. Where such a read is a plain attribute of a plain object (its
class resolves attributes by `object.__getattribute__`, the name is in the instance `__dict__`, no class on
the MRO makes it a data descriptor), the value is the instance dict's entry, and CPython bumps that dict's
version tag on every write to it (`obj.k = v`, `obj.__dict__[k] = v`, `object.__setattr__`; a replaced
`__dict__` is another dict, whose tag differs: tags are unique across dicts). So after a full pass of the
check, one C++ check (torch_internals.ObjectFacts) can say the reads would find the same objects again:
  - each object whose attributes were read: the same class, its instance dict unwritten, and the dicts of
    its class's MRO unwritten (Python, per call: the MRO tuple itself, a `__bases__` assignment makes a new
    one): no data descriptor, `__getattribute__` or `__getattr__` appeared;
  - a list read by index: its length and each item read, by identity (items change without any dict write);
    a tuple's items are fixed by its identity; a dict read by key: its version;
  - an input leaf by identity, held weakly (its death drops the memo: no other object takes its id, and what the
    caller let go of is not kept); the anchors tuple by identity (it is re-made after each watched write);
  - a class attribute as the MRO defines it (`mro_attr(Decoder, 'forward')`), an item of a class's `__dict__`:
    the class facts above; a global: the called function the same object, its globals dict unwritten;
  - a function's `__code__`, `__defaults__` and closure cells (the called function's, and those of functions
    reached so: in a class dict, a global, an attribute), a cell's contents: read in C by the builtin classes'
    getters on every call and compared by identity (they change with no dict write: `f.__code__ = ...`,
    `nonlocal x; x = 1`); their instance dicts (`f.__stampout_region__`) like any other object's.
Guards whose outcome is then fixed are left out of the check that still runs: identity, class (the class is
in the C++ check), constants of immutable types, lengths and keys of the containers above, absence, distinctness
of objects all vouched for (80 cache layers: the objects the full pass found distinct, the same objects now). The rest
still run, reading from the vouched objects (`anchors[k]` in the generated code): guards on anything else
(a config class with its own `__getattribute__`, closures, globals), and every tensor's metadata, which
in-place ops (`set_`, `resize_`, `as_strided_`) change with no dict write (DeferredTensors, the aliasing
check: the entry's). The values vouched for are the objects the full pass returned, the same objects now.

A memo that fails within a few calls of being made costs more than it saves. A dynamic cache stores new tensors
into its layers on every step: after three such memos the entry checks instance dicts entry by entry instead
(each vouched attribute's dict entry by identity, in C++; no absence settled), leaving out their tensors,
which the remaining check reads from the vouched layers on every call; after three more, no memo at all.

# Note: when a memo is made
Making a memo costs about as much as _PAYS full checks (~3 ms at 8 layers). A memo answers only calls on the
objects it was made on, so a memo made on a call whose inputs are new objects (a generate's new cache: the prefill
entry and the first decode step's, called once per generate) pays only if that run of calls on those objects lasts.
The entry keeps the run: the call's non-tensor inputs and the anchors' objects, by identity (`_fingerprint`; tensor
inputs are new each call and the memo does not fix them). A memo is made at once on an entry's first full check,
after a memo on the same inputs failed (a dict written in place: the strikes above), and on new inputs when the
last memo paid; on new inputs after one that did not, only once the run has lasted _PAYS full checks, as the
full checks it replaces would then have cost a memo (a generate of 10 tokens checks its decode step in full,
one of 100 makes a memo at its 16th step).
"""

from __future__ import annotations

import functools
import logging
import operator
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..sources import (MISSING, Absolute, Anchor, Arg, Attr, ClassAttr, Closure, FnAttr, Global, Item, SlotItem, Source,
                       mro_attr)
from ..torch_internals import ObjectFacts
from .guard import Guard, compile_guards
from .namespaces import class_dict, same_mros
from .rules import ApartFrom, Kind
from .values import IMMUTABLE_TYPES, OBJECT_GETATTRIBUTE

log = logging.getLogger("stampout.guards")

_TYPE_GETATTRIBUTE = type.__dict__["__getattribute__"]
_TYPE_DICT = type.__dict__["__dict__"]
# Attributes of builtin objects read in C by their class's getset (no Python code runs, the classes cannot be
# patched or subclassed): a function's code, defaults and closure cells, a cell's contents, a class's `__mro__`
# (its metaclass exactly `type`: a `__bases__` assignment makes another tuple), an exact tensor's `__dict__` (the
# getset torch.Tensor's class gives it; `t.persistent = False` writes that dict, whose version the facts then
# check). Unlike instance dict entries they change with no dict write (`f.__code__ = g.__code__`, `nonlocal x;
# x = 1`, `C.__bases__ = ...`): the C++ facts read them on every call and compare identities.
_READ_IN_C = types.MappingProxyType({types.FunctionType: frozenset({"__code__", "__defaults__", "__closure__"}),
                                     types.CellType: frozenset({"cell_contents"}), type: frozenset({"__mro__"}),
                                     torch.Tensor: frozenset({"__dict__"}),
                                     torch.nn.Parameter: frozenset({"__dict__"})})
_PAYS = 16  # calls a memo must hold for to have paid for itself
_STRIKES = 3  # memos that did not pay, after which an entry makes no more


def _data_descriptor(value: Any) -> bool:
    cls = type(value)
    return mro_attr(cls, "__set__") is not MISSING or mro_attr(cls, "__delete__") is not MISSING


def _instance_dict(obj: Any) -> dict | None:
    """`obj.__dict__` when its class resolves attributes plainly (object.__getattribute__, the standard `__dict__`
    slot): the dict every plain attribute read of it looks in; None otherwise."""
    cls = type(obj)
    if isinstance(obj, (torch.Tensor, type, types.ModuleType)) or mro_attr(cls, "__getattribute__") \
            is not OBJECT_GETATTRIBUTE:
        return None
    if type(mro_attr(cls, "__dict__")) is not types.GetSetDescriptorType:
        return None
    try:
        d = OBJECT_GETATTRIBUTE(obj, "__dict__")
    except AttributeError:
        return None
    return d if type(d) is dict else None


class _Memo:
    __slots__ = ("anchors", "facts", "roots", "mros", "rest", "combined", "values", "hits", "alive", "leaves",
                 "reuse", "__weakref__")

    def __init__(self) -> None:
        self.hits = 0
        self.reuse: Any = None  # (what the entry made of `values` once: entries.py)


class _Builder:
    """One memo: which sources the C++ facts vouch for (source -> the object there now), and those facts."""

    def __init__(self, leaves: list[Any], fn: Any, anchors: tuple, by_item: bool) -> None:
        self.leaves, self.fn, self.anchors = leaves, fn, anchors
        self.by_item = by_item  # instance dicts checked entry by entry (their tensors read per call), not by version
        self.globals_facts = False
        self.opaque: dict[Source, type] = {}  # a class's `__dict__`: its items vouched for, the proxy never handed out
        self.unnoded: set[Source] = set()  # vouched for by dict versions alone: no C++ node reaches them
        self.read_in_c: set[Source] = set()  # a builtin object's attribute (_READ_IN_C): its own node, by identity
        self.facts = ObjectFacts()
        self.split: dict[int, tuple[list[Source], ApartFrom]] = {}  # id(DISTINCT guard) -> its unfixed sides, the rest
        self.values: dict[Source, Any] = {}
        self.refused: set[Source] = set()
        self.absolutes: list[Any] = []
        self.class_dicts: list[dict] = []
        self.mros: dict[int, tuple[type, tuple]] = {}
        self._nodes: dict[Source, Any] = {}
        self._dict_nodes: dict[Source, Any] = {}
        self._roots = [None, None, None]
        self._class_root: Any = None
        self._class_nodes: dict[int, Any] = {}  # id(class) -> the node of its dict (version checked)
        self._class_nodes_mro: set[int] = set()  # id(class) whose `__mro__` the C++ facts check (_class_facts)
        self._globals_node: Any = None
        self._function_node: Any = None
        self._cells_node: Any = None

    # -- which sources are vouched for
    def vouch(self, source: Source) -> bool:
        if source in self.values:
            return True
        if source in self.refused:
            return False
        value = self._value(source)
        if value is _NO:
            self.refused.add(source)
            return False
        self.values[source] = value
        return True

    def _value(self, source: Source) -> Any:
        kind = type(source)
        if kind is Anchor:
            return self.anchors[source.index]
        if kind is Arg:
            return self.leaves[source.index] if source.index < len(self.leaves) else _NO
        if kind is Absolute:
            return source.obj
        if kind is Global:
            self.unnoded.add(source)
            return self.fn.__globals__.get(source.var, MISSING) if type(self.fn) is types.FunctionType else _NO
        if kind is Closure or kind is FnAttr:  # (the called function's cell, defaults or code: read in C)
            if type(self.fn) is not types.FunctionType:
                return _NO
            if kind is FnAttr:
                return getattr(self.fn, source.attr) if source.attr in _READ_IN_C[types.FunctionType] else _NO
            cells = self.fn.__closure__
            try:
                return cells[source.index].cell_contents if cells is not None and source.index < len(cells) else _NO
            except ValueError:  # (an empty cell)
                return _NO
        parent = source.base()
        if parent is None or not self.vouch(parent) or self.values[parent] is MISSING:
            return _NO
        obj = self.values[parent]
        if kind is Attr and source.attr in _READ_IN_C.get(type(obj), ()):  # (a node reaches any vouched parent)
            try:
                value = getattr(obj, source.attr)
            except ValueError:  # (an empty cell)
                return _NO
            self.read_in_c.add(source)
            return value
        if parent in self.opaque and kind is not Item:
            return _NO  # (a class's `__dict__`: the proxy is never handed out, its items are read)
        if kind is ClassAttr or parent in self.opaque:
            self.unnoded.add(source)
        if kind is ClassAttr:
            return mro_attr(obj, source.attr) if isinstance(obj, type) else _NO
        if kind is Attr and source.attr == "__dict__" and isinstance(obj, type):
            meta = type(obj)  # (its `__dict__` as type defines it: a proxy of the dict the class facts check)
            if mro_attr(meta, "__getattribute__") is not _TYPE_GETATTRIBUTE or mro_attr(meta, "__dict__") \
                    is not _TYPE_DICT:
                return _NO
            self.opaque[source] = obj
            self.unnoded.add(source)
            return class_dict(obj)
        if kind is Attr:
            return self._attr(obj, source.attr)
        if kind is Item:
            if parent in self.opaque and type(source.item) is not str:
                return _NO
            return self._item(obj, source.item)
        if kind is SlotItem and self.vouch(source.index) and type(self.values[source.index]) is int:
            return self._item(obj, self.values[source.index])
        return _NO

    def _attr(self, obj: Any, name: str) -> Any:
        d = _instance_dict(obj)
        if d is None:
            return _NO
        if name == "__dict__":
            return _NO if self.by_item else d
        cls = type(obj)
        found = mro_attr(cls, name)
        if name.startswith("__") and name.endswith("__") and found is not MISSING:
            return _NO  # (a dunder no class defines, `f.__stampout_region__`, is an instance dict entry)
        if name in d:
            if found is not MISSING and _data_descriptor(found):
                return _NO
            if self.by_item and isinstance(d[name], torch.Tensor):
                return _NO  # (what a dynamic cache stores anew each step: read per call)
            return d[name]
        return MISSING if found is MISSING and mro_attr(cls, "__getattr__") is MISSING and not self.by_item else _NO

    @staticmethod
    def _item(container: Any, key: Any) -> Any:
        t = type(container)
        if t in (list, tuple) and type(key) is int:
            return container[key] if -len(container) <= key < len(container) else _NO
        if t is dict and type(key) in (str, int):
            return container.get(key, MISSING)
        return _NO

    # -- the C++ facts that keep them
    def node(self, source: Source) -> Any:
        """The C++ node of a vouched source's object (made with the facts that reach it)."""
        if source in self._nodes:
            return self._nodes[source]
        value, kind = self.values[source], type(source)
        if kind is Anchor:
            node = self.facts.node(self._root(1, self.anchors), "tuple", source.index, value)
        elif kind is Absolute:
            self.absolutes.append(value)
            node = self.facts.node(self._root(2, None), "tuple", len(self.absolutes) - 1, value)
        elif kind is Arg:
            node = self.facts.node(self._root(0, self.leaves), "list", source.index, value)
            self.facts.same_object(node, value)
        elif source in self.read_in_c:
            self.reach(source.base())  # (the facts that fix the object it is read from)
            node = self.facts.node(self.node(source.base()), "attr", source.attr, value)
            self.facts.same_object(node, value)
        elif kind is Global:
            self._globals_facts()
            node = self.facts.node(self._globals_node, "dict", source.var, value)
        elif kind is FnAttr:
            node = self.facts.node(self._fn_node(), "attr", source.attr, value)
            self.facts.same_object(node, value)
        elif kind is Closure:  # (a function's closure tuple and its cells are fixed with the function)
            cells = self.fn.__closure__
            if self._cells_node is None:
                self._cells_node = self.facts.node(self._fn_node(), "attr", "__closure__", cells)
            cell = self.facts.node(self._cells_node, "tuple", source.index, cells[source.index])
            node = self.facts.node(cell, "attr", "cell_contents", value)
            self.facts.same_object(node, value)
        elif kind is ClassAttr or source.base() in self.opaque:  # (an item of a class's dict, found along an MRO)
            cls = self.values[source.base()] if kind is ClassAttr else self.opaque[source.base()]
            name = source.attr if kind is ClassAttr else source.item
            self._class_facts(cls)
            owner = next(klass for klass in cls.__mro__ if name in class_dict(klass))
            node = self.facts.node(self._class_nodes[id(owner)], "dict", name, value)
        else:
            parent = source.base()
            container = self.values[parent]
            if kind is Attr:
                owner = self._attributes_of(parent)
                node = owner if source.attr == "__dict__" else self.facts.node(owner, "dict", source.attr, value)
                if self.by_item:
                    self.facts.same_object(node, value)
            else:
                if kind is SlotItem:
                    self.node(source.index)  # (the index, fixed too)
                key = source.item if kind is Item else self.values[source.index]
                how = type(container).__name__
                node = self.facts.node(self._contents_of(parent), how, key, value)
                if how == "list":
                    self.facts.same_object(node, value)
        self._nodes[source] = node
        return node

    def _root(self, index: int, value: Any) -> Any:
        if self._roots[index] is None:
            self._roots[index] = self.facts.node(None, "tuple", index, value)
        return self._roots[index]

    def _attributes_of(self, source: Source) -> Any:
        """The node of the instance dict of the object at `source`, with its class's facts."""
        if source not in self._dict_nodes:
            obj = self.values[source]
            node = self.node(source)
            cls = type(obj)
            self.facts.same_class(node, cls)
            d = OBJECT_GETATTRIBUTE(obj, "__dict__")
            self._dict_nodes[source] = inner = self.facts.node(node, "instance dict", None, d)
            if not self.by_item:
                self.facts.unchanged_dict(inner, d)
            self._class_facts(cls)
        return self._dict_nodes[source]

    def _class_facts(self, cls: type) -> None:
        """The dicts along `cls`'s MRO unwritten (in C++), and the MRO itself (in C++ where its metaclass is exactly
        `type`, whose `__mro__` is read in C; else in Python: `same_mros`)."""
        if id(cls) not in self.mros and id(cls) not in self._class_nodes_mro:
            if type(cls) is type:  # (the tuple held too, as `same_mros` holds it: no other object takes its id)
                self.absolutes += (cls.__mro__, cls)
                node = self.facts.node(self._root(2, None), "tuple", len(self.absolutes) - 1, cls)
                self.facts.same_object(self.facts.node(node, "attr", "__mro__", cls.__mro__), cls.__mro__)
                self._class_nodes_mro.add(id(cls))
            else:
                self.mros[id(cls)] = (cls, cls.__mro__)
            if self._class_root is None:
                self._class_root = self.facts.node(None, "tuple", 3, None)
            for klass in cls.__mro__:
                if id(klass) in self._class_nodes:
                    continue  # (a base another class's MRO holds: its dict is checked once)
                self.class_dicts.append(d := class_dict(klass))
                node = self.facts.node(self._class_root, "tuple", len(self.class_dicts) - 1, d)
                self.facts.unchanged_dict(node, d)
                self._class_nodes[id(klass)] = node

    def _globals_facts(self) -> None:
        """The function the same object (so its `__globals__`), that dict unwritten."""
        if not self.globals_facts:
            self.globals_facts = True
            self._fn_node()
            self.absolutes.append(self.fn.__globals__)
            node = self.facts.node(self._root(2, None), "tuple", len(self.absolutes) - 1, self.fn.__globals__)
            self.facts.unchanged_dict(node, self.fn.__globals__)
            self._globals_node = node

    def _fn_node(self) -> Any:
        """The node of the called function, the same object."""
        if self._function_node is None:
            self._function_node = self.facts.node(None, "tuple", 4, self.fn)
            self.facts.same_object(self._function_node, self.fn)
        return self._function_node

    def _contents_of(self, source: Source) -> Any:
        """The node of a container whose items are read, with the facts that fix what they are."""
        if source not in self._dict_nodes:
            container, node = self.values[source], self.node(source)
            if type(container) is list:
                self.facts.same_length(node, len(container))
            elif type(container) is dict:
                self.facts.unchanged_dict(node, container)
            elif _dict_sized(container):  # (its keys and length, not its items: `_item` reads exact dicts only)
                self.facts.same_class(node, type(container))
                self.facts.unchanged_dict(node, container)
                self._class_facts(type(container))
            self._dict_nodes[source] = node
        return self._dict_nodes[source]

    def _fixed_table(self, source: Source, value: Any) -> bool:
        """A plain dict or list of immutable constants (a class's table: transformers' `_tp_plan`,
        `_no_split_modules`), its value fixed by facts: a dict's version, a list's length and its items by identity."""
        if type(value) not in (dict, list) or source in self.unnoded and not (
                type(source) is ClassAttr or source.base() in self.opaque):  # (a class's: noded from its dict's)
            return False
        if not all(_immutable(k) and _immutable(v) for k, v in (value.items() if type(value) is dict
                                                                  else enumerate(value))):
            return False
        node = self._contents_of(source)
        if type(value) is list:
            for i, item in enumerate(value):
                self.facts.same_object(self.facts.node(node, "list", i, item), item)
        return True

    def settles(self, guard: Guard) -> bool:
        """Whether the C++ facts fix `guard`'s outcome (it passed on the full pass the memo follows), adding the
        facts it needs."""
        source = guard.source
        if not self.vouch(source) or source in self.opaque:
            return False
        value, kind = self.values[source], guard.kind
        if value is MISSING:  # (absent from an unwritten instance dict and its classes, or from an unwritten dict)
            if kind not in (Kind.ABSENT, Kind.NO_OVERRIDE):
                return False
            self.reach(source)
            return True
        if kind is Kind.SAME:
            if not (self.vouch(guard.expected) and self.values[guard.expected] is value):
                return False
            self.reach(guard.expected)
        elif kind is Kind.CONST:
            if not _immutable(value) and not self._fixed_table(source, value):
                return False
        elif kind is Kind.DISTINCT:
            return self._apart(guard)
        elif kind in (Kind.LEN, Kind.KEYS):
            if source in self.unnoded or not (type(value) in ((list, tuple, dict) if kind is Kind.LEN else (dict,))
                                               or _dict_sized(value)):
                return False
            self._contents_of(source)
        elif kind is Kind.TYPE:
            if source in self.unnoded:
                return False
            self.facts.same_class(self.node(source), type(value))
        elif kind is not Kind.ID:
            return False
        self.reach(source)
        return True

    def _apart(self, guard: Guard) -> bool:
        """A DISTINCT guard: settled where the facts fix every object it compares (the objects the full pass found
        distinct, the same objects now: 80 cache layers); else, where they fix some, the rest compared with those
        by their ids (`self.split`). An input tensor is never fixed (a fresh one each call would fail the facts)."""
        sides = (guard.source, *guard.expected)
        fixed = [s for s in sides if self._fixable(s)]
        if len(fixed) == len(sides):
            for side in sides:
                self.reach(side)
            return True
        if len(fixed) > 1:
            for side in fixed:
                self.reach(side)
            self.split[id(guard)] = ([s for s in sides if s not in fixed], ApartFrom([self.values[s] for s in fixed]))
        return False

    def _fixable(self, source: Source) -> bool:
        """Vouched for, present, not a weak reference (which _distinct reads through: its referent may die) and not
        reached through an input tensor."""
        if not self.vouch(source) or self.values[source] is MISSING or source in self.opaque \
                or type(self.values[source]) is weakref.ref:
            return False
        root = source
        while root.base() is not None:
            root = root.base()
        return type(root) is not Arg or not isinstance(self.values[root], torch.Tensor)

    def reach(self, source: Source) -> None:
        """The facts on the path to a vouched source: its holder's where that fixes it (an attribute: the instance dict
        holding it; a tuple's item: the tuple; a dict's: the dict), else its own node (a list item: by identity)."""
        parent, kind = source.base(), type(source)
        if source in self.read_in_c:
            self.node(source)
        elif kind is Global:
            self._globals_facts()
        elif kind is ClassAttr:
            self.node(parent)
            self._class_facts(self.values[parent])
        elif parent in self.opaque:
            self.node(parent.base())
            self._class_facts(self.opaque[parent])
        elif kind is Attr and source.attr != "__dict__" and not self.by_item:
            self._attributes_of(parent)
        elif kind in (Item, SlotItem) and type(self.values[parent]) in (tuple, dict):
            if kind is SlotItem:
                self.node(source.index)
            self._contents_of(parent)
        else:
            self.node(source)


_NO = object()  # (not vouched for)
_DICT_ITER, _DICT_LEN = dict.__dict__["__iter__"], dict.__dict__["__len__"]


def _dict_sized(value: Any) -> bool:
    """An instance of a dict subclass that iterates and counts as dict does (a watched module's `_modules`, whose
    class bumps EPOCH on item writes): its keys, in order, and its length are fixed by its dict version tag while
    its class (same_class) and the dicts along its MRO (no `__iter__` or `__len__` added) are unchanged."""
    cls = type(value)
    return isinstance(value, dict) and mro_attr(cls, "__iter__") is _DICT_ITER and mro_attr(cls, "__len__") is _DICT_LEN


def _immutable(value: Any) -> bool:
    """A value no write can change: a constant of an immutable type, or a tuple of such (a function's defaults)."""
    return type(value) in IMMUTABLE_TYPES or type(value) is tuple and all(map(_immutable, value))


class InstanceFacts:
    """The memo of one entry's per-call check (see the note above): `run(check, leaves, fn, anchors)` answers
    what `check(leaves, fn, anchors)` would."""

    __slots__ = ("guards", "values", "deferred", "_memo", "_strikes", "_mode", "hits", "made", "_run", "_length",
                 "_paid", "_made_in_run", "__weakref__")

    def __init__(self, guards: list[Guard], results: list[Source], deferred: list[Guard]) -> None:
        self.guards = guards
        self.values = [*results, *(g.source for g in deferred)]  # (what the check returns, in order)
        self.deferred = {id(g) for g in deferred}
        self._memo: _Memo | None = None
        self._strikes = 0
        self._mode = 0  # 0: instance dicts by version; 1: entry by entry; 2: no memo
        self.hits = 0  # (calls the memo answered: tests read it)
        self.made = 0  # (memos made: tests read it)
        self._run: tuple | None = None  # the inputs of the calls since they last changed (`_fingerprint`)
        self._length = 0  # full checks in that run
        self._made_in_run = False  # whether a memo was made in that run
        self._paid = True  # whether the last memo paid (none made yet: as if it had)

    def run(self, check: Callable, leaves: list[Any], fn: Any, anchors: tuple) -> Any:
        memo = self._memo
        if memo is not None:
            roots = memo.roots  # (the called function as it is now: the facts compare it with the memo's)
            if memo.anchors is anchors and same_mros(memo.mros) and memo.facts.check((leaves, *roots[:3], fn)):
                memo.hits += 1
                self.hits += 1
                out = memo.rest(leaves, fn, memo.combined)
                return memo.values if out is True else out
            self._drop(memo)
        values = check(leaves, fn, anchors)
        if values is not False and self._mode < 2 and self._due(leaves, anchors):
            try:
                self._memo = self._make(leaves, fn, anchors, values)
                self.made += 1
                self._made_in_run = True
            except Exception as e:  # (a memo is an optimization: without one the full check runs, as it just did)
                log.debug("no instance-facts memo for this entry: %s: %s", type(e).__name__, e)
                self._memo, self._mode = None, 2
        return values

    def _due(self, leaves: list[Any], anchors: tuple) -> bool:
        """Whether to make a memo after this full check (the note on when a memo is made)."""
        run = self._run
        if run is not None and len(run[0]) == len(anchors) and all(map(operator.is_, run[0], anchors)) \
                and len(run[1]) == len(leaves) and all(
                (r() is v if type(r) is weakref.ref else r == id(v)) for r, v in zip(run[1], leaves)
                if not isinstance(v, torch.Tensor)):
            self._length += 1
        else:
            self._run, self._length, self._made_in_run = _fingerprint(leaves, anchors), 1, False
        return self._made_in_run or self._paid or self._length >= _PAYS

    def _drop(self, memo: _Memo) -> None:
        if self._memo is not memo:
            return
        self._memo = None
        self._paid = memo.hits >= _PAYS
        if memo.hits < _PAYS:
            self._strikes += 1
            if self._strikes == _STRIKES:
                self._mode, self._strikes = self._mode + 1, 0

    def recall(self, values: tuple) -> Any:
        """What `keep` stored with `values`, while the memo that answered with them holds; else None."""
        memo = self._memo
        return memo.reuse if memo is not None and memo.values is values else None

    def keep(self, values: tuple, reuse: Any) -> None:
        """Store `reuse` (what the caller made of `values`) with the memo that answered with `values`."""
        memo = self._memo
        if memo is not None and memo.values is values:
            memo.reuse = reuse

    def _make(self, leaves: list[Any], fn: Any, anchors: tuple, values: tuple) -> _Memo | None:
        b = _Builder(leaves, fn, anchors, self._mode == 1)
        kept = [g for g in self.guards if id(g) not in self.deferred and not b.settles(g)]
        vouched = all(b.vouch(s) and b.values[s] is not MISSING and s not in b.opaque for s in self.values)
        if vouched:
            if any(b.values[s] is not v for s, v in zip(self.values, values)):
                return None  # (not the objects the check returned: nothing to memoize on)
            for source in self.values:
                b.reach(source)
        extra: list[Any] = []
        slots: dict[Source, Source] = {}

        def rewrite(source: Source) -> Source:
            if source in slots:
                return slots[source]
            if type(source) not in (Anchor, Absolute, Arg) and source not in b.opaque and b.vouch(source) \
                    and b.values[source] is not MISSING:
                b.reach(source)  # (the facts that fix it)
                extra.append(b.values[source])
                new: Source = Anchor(len(anchors) + len(extra) - 1, source.name())
            elif isinstance(source, SlotItem):
                new = SlotItem(rewrite(source.parent), rewrite(source.index))
            elif source.base() is None:
                new = source
            else:
                new = source.with_parent(rewrite(source.base()))
            slots[source] = new
            return new

        def apart(guard: Guard) -> Guard:  # (a DISTINCT guard with some objects fixed: the others compared with them)
            sides, fixed = b.split[id(guard)]
            extra.append(fixed)
            held = Anchor(len(anchors) + len(extra) - 1, f"the {len(fixed.ids)} objects of it the facts fix")
            return Guard(rewrite(sides[0]), Kind.DISTINCT, (*map(rewrite, sides[1:]), held), guard.where)

        rest_guards = [apart(g) if id(g) in b.split else
                       Guard(rewrite(g.source), g.kind, rewrite(g.expected) if g.kind is Kind.SAME else
                             tuple(map(rewrite, g.expected)) if g.kind is Kind.DISTINCT else g.expected, g.where)
                       for g in kept]
        memo = _Memo()
        memo.rest = compile_guards(rest_guards, None if vouched else [rewrite(s) for s in self.values])
        memo.anchors, memo.facts, memo.values = anchors, b.facts, values
        memo.roots = (anchors, tuple(b.absolutes), tuple(b.class_dicts), fn)
        memo.mros = list(b.mros.values())
        memo.combined = (*anchors, *extra)
        # The C++ facts compare ids: the objects vouched for stay alive while the memo does, so that no other object
        # takes one's id. The call's inputs are held weakly instead: one dying (the caller let go of it) drops the
        # memo at once (before its id can be reused), which lets go of all the memo held of it, as eager would.
        leaves = {id(v): v for s, v in b.values.items() if type(s) is Arg and type(v).__weakrefoffset__}
        memo.alive = [v for v in b.values.values() if id(v) not in leaves]
        died = functools.partial(_died, weakref.ref(self), weakref.ref(memo))
        memo.leaves = [weakref.ref(v, died) for v in leaves.values()]
        return memo


def _fingerprint(leaves: list[Any], anchors: tuple) -> tuple:
    """The run a call belongs to: the objects of the anchors tuple (re-made, the same objects, after a write to a
    watched module), and each non-tensor input, held weakly where it can be (another object may take a dead one's
    id), else by its id (None, small ints, strings: `_due` compares them so)."""
    return anchors, [None if isinstance(v, torch.Tensor) else weakref.ref(v) if type(v).__weakrefoffset__ else id(v)
                     for v in leaves]


def _died(held: weakref.ref, made: weakref.ref, _: Any) -> None:
    """An input a memo vouched for died: that memo answers no more (`_drop`: if it is still the entry's)."""
    facts, memo = held(), made()
    if facts is not None and memo is not None:
        facts._drop(memo)
