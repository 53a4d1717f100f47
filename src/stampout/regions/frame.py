"""RegionFrame: what one region trace read, as guards on sources relative to the call's arguments."""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from typing import Any

import torch

from ..frames import user_location
from ..guards import Guard, Kind, const_key, hooks_key, is_constant, snapshot, tensor_meta
from ..sources import MISSING, Absolute, Arg, Attr, Closure, FnAttr, Global, Item, Source
from ..tracking import Watch, original_class, shim_class, write_shim_class
from .marker import innermost

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict, torch.nn.ParameterList,
               torch.nn.ParameterDict)
_GLOBAL_NAMES: dict[types.CodeType, tuple[str, ...]] = {}
_MAX_ITEMS = 256  # containers read by a trace with more items than this are not guarded item by item


def _contents(value: Any) -> Any:
    if is_constant(value):
        return const_key(value)
    if type(value) is dict:
        return tuple((k, id(v)) for k, v in value.items())
    return tuple(id(v) for v in value)


def global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names a code object (and the code nested in it) may load as globals."""
    names = _GLOBAL_NAMES.get(code)
    if names is None:
        found = list(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found.extend(global_names(const))
        names = _GLOBAL_NAMES[code] = tuple(dict.fromkeys(found))
    return names


def _accepted_types(obj: Any) -> tuple[type, ...]:
    """The object's class and the shim classes stampout may have swapped in (read and write watching)."""
    cls = original_class(obj)
    if not hasattr(obj, "__dict__"):
        return (cls,)
    return (cls, *(s for s in (shim_class(cls), write_shim_class(cls)) if s is not None))


class RegionFrame:
    """Reads recorded while one region call is traced, and why its trace may not be reusable."""

    def __init__(self, fn: Callable, leaves: list[Any], labels: list[str], watch: Watch) -> None:
        self.fn = fn
        self.leaves = leaves
        self.watch = watch
        self.sources: dict[int, Source] = {}
        self._keep: list[Any] = []
        self.guards: list[Guard] = []
        self._guarded: set[tuple[Source, Kind]] = set()
        self.ineligible: list[str] = []
        self.reads_requires_grad = False
        self.writes: list[str] = []  # Python side effects on objects from outside: "target at file:line"
        self._functions: set[types.CodeType] = set()
        self._containers: list[tuple[Any, Source, tuple]] = []  # functions whose globals and cells are guarded
        self.lifted: list[tuple[str, Any]] = []  # ("arg", leaf index) | ("source", Source | None)
        for i, leaf in enumerate(leaves):
            if not is_constant(leaf):
                self.adopt(leaf, Arg(i, labels[i]), from_arg=True)
        self._input_meta = [(i, tensor_meta(t)) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        self._adopt_function(fn, None, depth=0)

    # ---- recording ------------------------------------------------------------------------------
    def guard(self, source: Source, kind: Kind, expected: Any, where: str = "") -> None:
        if (source, kind) not in self._guarded:
            self._guarded.add((source, kind))
            self.guards.append(Guard(source, kind, expected, where or user_location(3)))

    def _name(self, obj: Any, source: Source) -> None:
        if id(obj) not in self.sources:
            self.sources[id(obj)] = source
            self._keep.append(obj)

    def adopt(self, value: Any, source: Source, from_arg: bool = False, where: str = "") -> None:
        """Guard `value`, found at `source`, and remember the source of objects read through it."""
        if value is MISSING:
            self.guard(source, Kind.ABSENT, MISSING, where)
        elif isinstance(value, torch.Tensor):
            if not from_arg:
                self.guard(source, Kind.TENSOR, tensor_meta(value), where)
            self._name(value, source)
        elif is_constant(value):
            if not from_arg:
                self.guard(source, Kind.CONST, const_key(value), where)
            if type(value) in (list, dict, set):  # mutable: changing it in the trace is a side effect
                self._containers.append((value, source, _contents(value)))
        elif isinstance(value, torch.nn.Module):
            if not from_arg:
                self.guard(source, Kind.TYPE, _accepted_types(value), where)
            self.guard(source, Kind.HOOKS, hooks_key(value), where)
            self._name(value, source)
            self.watch.watch(value)
            forward = innermost(getattr(original_class(value), "forward", None))
            if isinstance(forward, types.FunctionType) and _is_user_code(forward):
                self._adopt_function(forward, Absolute(forward, forward.__qualname__), depth=1)
            if isinstance(value, _CONTAINERS):
                self._adopt_children(value, source, where)
        elif isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
                                types.ModuleType)) or callable(value) and not hasattr(value, "__dict__"):
            self.guard(source, Kind.ID, value, where)
        elif type(value) in (list, tuple, dict):
            self._adopt_container(value, source, where)
        elif self.watch.watch(value):
            if not from_arg:
                self.guard(source, Kind.TYPE, _accepted_types(value), where)
            self._name(value, source)
        elif hasattr(value, "__dict__"):
            self.guard(source, Kind.TYPE, _accepted_types(value), where)
            self.guard(source, Kind.SNAPSHOT, snapshot(value), where)
        else:
            self.guard(source, Kind.ID, value, where)

    def _adopt_container(self, value: list | tuple | dict, source: Source, where: str) -> None:
        """A list, tuple or dict holding more than constants: guard its shape and each item by its own
        source (so a cache object inside is watched), and check at the end that the trace did not mutate it."""
        self.guard(source, Kind.TYPE, (type(value),), where)
        self.guard(source, Kind.LEN, len(value), where)
        if id(value) in self.sources:
            return
        self._name(value, source)
        if len(value) > _MAX_ITEMS:
            self.guard(source, Kind.ID, value, where)
            self.mark_ineligible(f"reads {source.name()}, a {type(value).__name__} of {len(value)} items")
            return
        if type(value) is dict:
            self.guard(source, Kind.KEYS, tuple(value), where)
        for key, item in (value.items() if type(value) is dict else enumerate(value)):
            self.adopt(item, Item(source, key), where=where)
        self._containers.append((value, source, _contents(value)))

    def close(self) -> None:
        """At the end of the trace: a container it read and changed is a side effect too, and so is an
        input whose shape, strides or requires_grad changed in place (a stamped call would not change them)."""
        for i, meta in self._input_meta:
            if tensor_meta(self.leaves[i]) != meta:
                self.mark_ineligible(f"changes the metadata of its input {i} in place (resize_, transpose_, ...)")
        for value, source, before in self._containers:
            if _contents(value) != before:
                self.writes.append(f"{source.name()} (changed in place)")
                self.mark_ineligible(f"changes {source.name()} in place (a Python side effect)")

    def _adopt_children(self, container: torch.nn.Module, source: Source, where: str) -> None:
        self.guard(source, Kind.LEN, len(container), where)
        children = container.__dict__.get("_parameters") or {}
        children = {**children, **container.__dict__.get("_modules", {})}
        for key, child in children.items():
            if child is not None:
                self.adopt(child, Attr(source, key), where=where)

    def _adopt_function(self, fn: Callable, as_source: Source | None, depth: int) -> None:
        """Guard the closure cells and globals a function (and functions it names) may read."""
        code = getattr(fn, "__code__", None)
        if code is None or (as_source is not None and code in self._functions):
            return
        self._functions.add(code)
        for attr in ("__defaults__", "__kwdefaults__"):  # a default the call did not pass is read too
            default = getattr(fn, attr, None)
            if default is not None:
                source = FnAttr(attr) if as_source is None else Attr(as_source, attr)
                self.adopt(default, source, where=f"defaults of {code.co_qualname}")
        closure = getattr(fn, "__closure__", None) or ()
        for i, var in enumerate(code.co_freevars):
            try:
                value = closure[i].cell_contents
            except (IndexError, ValueError):
                continue
            cell = (Closure(i, var) if as_source is None
                    else Attr(Item(Attr(as_source, "__closure__"), i), "cell_contents"))
            self.adopt(value, cell, where=f"closure of {code.co_qualname}")
        g = fn.__globals__
        g_source = None if as_source is None else Absolute(g, f"{fn.__module__}.globals")
        for name in global_names(code):
            if name not in g:
                continue
            value = g[name]
            if isinstance(value, types.ModuleType):
                continue
            src = Global(name) if g_source is None else Item(g_source, name)
            self.adopt(value, src, where=f"global of {code.co_qualname}")
            if depth < 2 and isinstance(value, types.FunctionType) and _is_user_code(value):
                self._adopt_function(value, Absolute(value, value.__qualname__), depth + 1)

    def on_read(self, obj: Any, name: str, value: Any) -> None:
        base = self.sources.get(id(obj))
        if base is None and obj not in self.watch:
            return  # made during this capture (`type(self)(...)` of a watched object, a ModuleList slice)
        if base is None:
            self.mark_ineligible(
                f"reads .{name} of a {type(obj).__name__} not reachable from its arguments, closures or globals"
            )
            return
        self.adopt(value, Attr(base, name), where=user_location(3))

    def on_write(self, obj: Any, name: str) -> None:
        base = self.sources.get(id(obj))
        target = f"{base.name()}.{name}" if base is not None else f"a {type(obj).__name__}.{name}"
        where = user_location(3)
        self.writes.append(f"{target} at {where}")
        self.mark_ineligible(f"writes {target} (a Python side effect) at {where}")

    def leaves_contain(self, value: Any) -> bool:
        return any(leaf is value for leaf in self.leaves)

    def mark_ineligible(self, reason: str) -> None:
        if reason not in self.ineligible:
            self.ineligible.append(reason)

    # ---- a nested region call that was stamped out instead of traced -----------------------------
    def import_entry(self, entry: Any, leaves: list[Any], fn: Callable, lifted_values: list[Any]) -> None:
        """Take over the guards of a nested entry stamped out during this trace, rebased onto our sources."""

        def translate(root: Source) -> Source | None:
            if isinstance(root, Arg):
                return self.sources.get(id(leaves[root.index]))
            if isinstance(root, Closure):
                return Attr(Item(Attr(Absolute(fn, fn.__qualname__), "__closure__"), root.index), "cell_contents")
            if isinstance(root, Global):
                return Item(Absolute(fn.__globals__, f"{fn.__module__}.globals"), root.var)
            if isinstance(root, FnAttr):
                return Attr(Absolute(fn, fn.__qualname__), root.attr)
            return root

        for guard in entry.guards:
            source = guard.source.rebase(translate)
            if source is None:
                self.mark_ineligible(f"calls region {entry.region} with an argument it cannot name")
                return
            self.guard(source, guard.kind, guard.expected, guard.where)
        for (kind, spec), value in zip(entry.lifted, lifted_values):
            if kind == "source" and isinstance(value, torch.Tensor):
                source = spec.rebase(translate)
                if source is not None:
                    self._name(value, source)


_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)


def _is_user_code(fn: types.FunctionType) -> bool:
    return not fn.__code__.co_filename.startswith(_LIBRARY_DIRS)
