"""A reuse entry's guards split in two: facts of the call (checked every call) and facts shared by every call.

# Note: shared facts, checked once per entry and re-checked by dict version
The 2nd..Nth call of a region (32 decoder layers) differ in the module instance, its parameters and the
arguments, but not in what the code they run reads from classes and module globals: `F`, `torch`, `EPS`,
`Attention.__dict__['forward']`, `type(self.attn).forward`. Those guards depend only on a few dicts: the
region function's globals, the class dicts along a fixed class's MRO. CPython bumps a dict's version tag on
every write to it, so after the shared guards pass once, one C++ check (`dict_sentinel`) over those dicts
says they all still hold; any write to one of the dicts (a global rebound, a class attribute set or deleted,
even an unrelated one) makes the shared guards run again, in full, before the call may be stamped. What the
dicts cannot vouch for stays in the per-call part: the function's own `__code__`/`__defaults__` (no dict),
attributes of instances, mutable constants (a list's items change without a write to the dict holding it).
The identities the dicts are reached through are checked every call: the region function (its `__globals__`)
and each fixed class's `__mro__` tuple (a `__bases__` assignment makes a new one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..sources import Absolute, Attr, ClassAttr, Global, Item, Source, TypeOf
from ..torch_internals import dict_sentinel
from .guard import DeferredTensors, Guard, compile_guards
from .namespaces import class_dict, same_mros
from .rules import Kind

# constants whose value cannot change without rebinding the name (the dict holding it is written)
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes)
_SHAREABLE = (Kind.ID, Kind.ABSENT)


def _original(cls: type) -> type:
    return cls.__dict__.get("_stampout_original", cls)  # (a watching shim stands in for the class: TypeOf)


def _fixed_classes(guards: list[Guard]) -> dict[Source, tuple[type, tuple[type, ...]]]:
    """Sources a TYPE guard fixes to one class (after shims): source -> (that class, the classes passing)."""
    fixed = {}
    for g in guards:
        if g.kind is Kind.TYPE and all(isinstance(k, type) for k in g.expected):
            originals = {_original(k) for k in g.expected}
            if len(originals) == 1:
                fixed[g.source] = (originals.pop(), tuple(g.expected))
    return fixed


def _kind_shareable(guard: Guard) -> bool:
    return guard.kind in _SHAREABLE or (guard.kind is Kind.CONST and guard.expected[0] in _IMMUTABLE)


class _Split:
    """Which guards are shared, with the dicts they depend on and the identities those are reached by."""

    def __init__(self, guards: list[Guard]) -> None:
        self.dicts: dict[int, dict] = {}
        self.mros: dict[int, tuple[type, tuple]] = {}  # id(class) -> (class, its __mro__ when split)
        self.uses_fn = False
        self.shared: list[Guard] = []
        self.per_call: list[Guard] = []
        self.rewritten: list[Guard] = []  # the shared guards, their sources rooted at the fixed classes
        fixed = _fixed_classes(guards)
        for g in guards:
            source = self._shared_source(g, fixed) if _kind_shareable(g) else None
            if source is None:
                self.per_call.append(g)
            else:
                self.shared.append(g)
                self.rewritten.append(Guard(source, g.kind, g.expected, g.where))

    def _watch_class(self, cls: type) -> None:
        self.mros[id(cls)] = (cls, cls.__mro__)
        for klass in cls.__mro__:
            self.dicts[id(klass)] = class_dict(klass)

    def _shared_source(self, g: Guard, fixed: dict) -> Source | None:
        source = g.source
        if isinstance(source, Global):
            self.uses_fn = True
            return source
        if (isinstance(source, Item) and type(source.item) is str and isinstance(source.parent, Attr)
                and source.parent.attr == "__dict__" and isinstance(source.parent.parent, Absolute)
                and type(source.parent.parent.obj) is type):
            self.dicts[id(source.parent.parent.obj)] = class_dict(source.parent.parent.obj)
            return source
        if isinstance(source, ClassAttr) and isinstance(source.parent, TypeOf) and source.parent.parent in fixed:
            cls, passing = fixed[source.parent.parent]
            if type(cls) is not type or any(type(k) is not type for k in passing):
                return None
            self._watch_class(cls)
            for k in passing:  # (the shim's `_stampout_original` is read from its dict)
                self.dicts[id(k)] = class_dict(k)
            return ClassAttr(Absolute(cls, cls.__qualname__), source.attr)
        return None


class EntryCheck:
    """The predicate of a reuse entry, called like `compile_guards`' (`check(leaves, fn)`): the shared guards
    while a watched dict moved or the function differs, then the per-call guards (see the note above)."""

    __slots__ = ("per_call", "shared", "_deferred", "_n", "_dicts", "_mros", "_uses_fn", "_fn", "_sentinel",
                 "shared_checks")

    def __init__(self, per_call: Callable, shared: Callable | None, split: _Split, deferred: list[Guard],
                 n_results: int) -> None:
        self.per_call = per_call
        self.shared = shared
        self._deferred = DeferredTensors(deferred) if deferred else None
        self._n = n_results
        self._dicts = list(split.dicts.values())
        self._mros = list(split.mros.values())
        self._uses_fn = split.uses_fn
        self._fn: Any = None
        self._sentinel: Callable[[], bool] | None = None
        self.shared_checks = 0  # how often the shared guards ran in full (tests read it)

    def __call__(self, leaves: list[Any], fn: Any) -> Any:
        sentinel = self._sentinel
        if sentinel is None or (self._uses_fn and fn is not self._fn) or not sentinel() or not same_mros(self._mros):
            self._sentinel = None
            self.shared_checks += 1
            if self.shared is not None and not self.shared(leaves, fn):
                return False
            self._fn = fn
            dicts = [*self._dicts, fn.__globals__] if self._uses_fn else self._dicts
            self._sentinel = dict_sentinel(dicts) if dicts else _always
        values = self.per_call(leaves, fn)
        if values is False or self._deferred is None:
            return values
        admitted = self._deferred.admit(values, self._n)
        return False if admitted is None else admitted

    # (what report.guard_code_text prints, comments left out: the per-call predicate, then `shared`)
    @property
    def source_code(self) -> str:
        if self.shared is None:
            return self.per_call.source_code
        return self.per_call.source_code + "\n" + self.shared.source_code.replace("def check(", "def shared(", 1)

    @property
    def __code__(self) -> Any:
        return self.per_call.__code__

    @property
    def __globals__(self) -> dict:
        return self.per_call.__globals__


def _always() -> bool:
    return True


def compile_entry_guards(guards: list[Guard], results: list[Source]) -> EntryCheck:
    """A reuse entry's predicate, admitting exactly what `compile_guards(guards, results)` admits: the shared
    guards as above, the per-call ones with their tensor metadata in one C++ check (`DeferredTensors`)."""
    split = _Split(guards)
    shared = None
    if split.shared:
        shared = compile_guards(split.rewritten)
        shared.guards = split.shared  # (as the trace recorded them, for the report)
    deferred: list[Guard] = []
    per_call = compile_guards(split.per_call, results, deferred)
    return EntryCheck(per_call, shared, split, deferred, len(results))
