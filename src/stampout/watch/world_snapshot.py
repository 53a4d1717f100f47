"""What user code run by a capture could reach by name, as it was before it ran (see world.py).

Memo caches (`functools.lru_cache` wrappers, dicts and lists in module globals, class dicts), module globals and
namespace modules (`metrics.LAST = n`): `Snapshot` remembers, for each user code the capture runs, what it may
reach before it runs; `Snapshot.repair` restores the containers and slots that now hold a fake (or clears the
cache that does) and says what it repaired; a region trace that changed them is told apart by `changed_since`.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import config
from ..sources import Place
from ..torch_internals import FakeTensor
from ..trace.code import code_facts, is_user_class, is_user_code, is_user_file, is_user_module
from ..trace.shapes import concrete
from ..trace.structure import ATOMIC, tensors_within
from .classpatch import PATCHED_NAMES
from .functools_caches import held_results, remove_traced_results
from .world import fake_places, holds_fake

_GONE = object()


def _class_state(klass: type) -> dict:
    """A class's own attributes, less dunder names and those stampout's read and write shims install."""
    return {k: v for k, v in vars(klass).items() if not (k.startswith("__") and k.endswith("__"))
            and k not in PATCHED_NAMES}


def _identities(container: Any) -> tuple:
    if type(container) is dict:
        return tuple((k, id(v)) for k, v in list(container.items()))
    return tuple(id(v) for v in container)


def _running_local(frame: types.FrameType, name: str, value: Any) -> bool:
    """Whether the closure variable `name` of the code running in `frame` is a local of a user frame still running
    below it (the call's `**kwargs` a comprehension reads, a nested function called in place): made by this call,
    not state kept between calls. The walk stops at the first frame not of user code (torch's module call,
    stampout's capture): a closure over a frame above the capture (a test's list) is user state."""
    f = frame.f_back
    while f is not None and is_user_file(f.f_code.co_filename):
        if name in f.f_code.co_cellvars and f.f_locals.get(name, _GONE) is value:
            return True
        f = f.f_back
    return False


@dataclass
class Snapshot:
    """What user code run by a capture could reach by name, as it was before that code first ran."""

    containers: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # id -> (dict | list, shallow copy)
    caches: dict[int, tuple[Any, int]] = field(default_factory=dict)  # id -> (lru wrapper, misses before)
    classes: dict[int, tuple[type, dict]] = field(default_factory=dict)  # id -> (user class, its attributes)
    traced_caches: list[str] = field(default_factory=list)  # functools caches a trace stored a traced value in
    filled_caches: list[Any] = field(default_factory=list)  # (drawn at random or not: the caches themselves)
    hits: dict[int, int] = field(default_factory=dict)  # id -> hits of the cache when noted
    settings: dict[str, tuple[dict, dict]] = field(default_factory=dict)  # torch.backends.* namespaces, as noted
    cells: dict[int, tuple[Any, Any, str]] = field(default_factory=dict)  # id -> (closure cell, contents, label)
    walked_clean: dict[int, Any] = field(default_factory=dict)  # (see repair; for check_left_over only)
    _seen: set[tuple[int, int]] = field(default_factory=set)

    def note_program(self, fns: list[Any], depth: int = 3) -> None:
        """Before the program runs: the code of `fns` (its function, the methods of its modules' classes) and
        of the user functions their globals name, `depth` calls deep, as `note_code` would see them run."""
        for fn in fns:
            code, g = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
            if code is None or g is None or (id(code), id(g)) in self._seen or not is_user_code(code):
                continue
            self._seen.add((id(code), id(g)))
            self.note(g, 0)
            called = []
            facts = code_facts(code)
            cells = _cells(fn)  # (what it closes over: the frame's free variables once it runs)
            self._note_cells(fn)
            for value in [*(g.get(name) for name in facts.names), *cells.values()]:
                if value is not None:
                    self.note(value, 1)
                    if isinstance(value, types.FunctionType):
                        called.append(value)
            self._note_store_targets(facts.attribute_stores, g, cells)
            if depth:
                self.note_program(called, depth - 1)

    def _note_cells(self, fn: Any) -> None:
        """`fn`'s closure cells with what they hold: a `nonlocal` the program rebinds (`state = state + x`) is
        user state the function keeps, as an attribute is."""
        for i, cell in enumerate(fn.__closure__ or ()):
            self._note_cell(cell, fn, i, _contents(cell))

    def _note_cell(self, cell: Any, fn: Any, i: int, before: Any) -> None:
        if id(cell) not in self.cells:
            code = fn.__code__
            label = f"the closure variable {code.co_freevars[i]} of {code.co_qualname} ({code.co_filename}:" \
                    f"{code.co_firstlineno})"
            self.cells[id(cell)] = (cell, before, label)

    def note_cells_read(self, cells: list[tuple[Any, Any, Any]]) -> None:
        """Closure cells of functions a trace reached as values (`self.steps["ema"]`: made before the call, first
        reached during it), each with its function and what it held when the trace read it, before its code ran."""
        for cell, fn, before in cells:
            i = next(i for i, c in enumerate(fn.__closure__) if c is cell)  # (cells compare by their contents)
            self._note_cell(cell, fn, i, before)

    def rebound_cells(self) -> list[str]:
        """The noted closure cells the program rebound to a value holding a fake tensor or a symbolic size: each
        given back what it held (the graph computed the value, not the cell: compile runs such a program
        eagerly, capture refuses it). Their labels."""
        rebound = []
        for cell, before, label in self.cells.values():
            now = _contents(cell)
            if now is before or not holds_fake(now, whole=True):
                continue
            if before is _GONE:
                del cell.cell_contents
            else:
                cell.cell_contents = before
            rebound.append(label)
        return rebound

    def note_settings(self) -> None:
        """Before the program runs: the namespaces of torch's settings modules (`torch.backends.opt_einsum.enabled`
        is a plain attribute of a module object, set with no C call: see regions/purity.py for the others)."""
        for module in list(vars(torch.backends).values()):  # (its submodules, as imported)
            fields = (getattr(module, "__dict__", None)
                      if isinstance(module, types.ModuleType) and module is not torch.backends else None)
            if type(fields) is dict and module.__name__ not in self.settings:
                self.settings[module.__name__] = (fields, dict(fields))

    def settings_changed(self, state: dict[Any, Any] | None = None) -> list[str]:
        """`module.name` of each torch setting rebound, added or deleted since `state` (else since noted)."""
        changed = []
        for module, (fields, noted) in self.settings.items():
            then = noted if state is None else state.get(("setting", module), noted)
            if len(then) == len(fields) and all(fields.get(k, _GONE) is v for k, v in then.items()):
                continue
            changed += [f"{module}.{k}" for k in dict.fromkeys([*then, *fields])
                        if then.get(k, _GONE) is not fields.get(k, _GONE)]
        return changed

    def saw(self, code: types.CodeType, g: dict) -> bool:
        return (id(code), id(g)) in self._seen

    def note_code(self, frame: types.FrameType, names: tuple[str, ...]) -> None:
        """User code is about to run in `frame`: remember its globals dict, what its global names reach, and
        the class of its `self` (memo dicts and caches kept on the class)."""
        code, g = frame.f_code, frame.f_globals
        key = (id(code), id(g))
        if key in self._seen:
            return
        self._seen.add(key)
        if code.co_argcount and code.co_varnames[0] in ("self", "cls"):
            first = frame.f_locals.get(code.co_varnames[0])
            self.note(first if isinstance(first, type) else type(first), 1)
        self.note(g, 0)
        for name in names:
            value = g.get(name)
            if value is not None:
                self.note(value, 1)
        cells = {}
        if code.co_freevars:  # containers it closes over (a list the forward appends to)
            local = frame.f_locals
            cells = {name: local.get(name) for name in code.co_freevars}
            for name, value in cells.items():
                if not _running_local(frame, name, value):
                    self.note(value, 1)
        self._note_store_targets(code_facts(code).attribute_stores, g, cells)

    def _note_store_targets(self, chains: list[tuple[str, ...]], g: dict, cells: dict[str, Any]) -> None:
        """A module the code stores an attribute into (`cfg.last = h`), reached through a global or a closure
        cell, a user's or a library's: its namespace is remembered, so a traced value left there is found."""
        for chain in chains:
            target = g.get(chain[0], cells.get(chain[0]))
            if isinstance(target, types.ModuleType) and type(getattr(target, "__dict__", None)) is dict:
                self.note(target.__dict__, 0)

    def note(self, value: Any, depth: int) -> None:
        """Remember `value` (and what it holds, a few levels deep) if it is a container or a memo cache."""
        if depth > config.scan_depth or id(value) in self.containers or id(value) in self.caches:
            return
        if isinstance(value, functools._lru_cache_wrapper):
            info = value.cache_info()
            self.caches[id(value)] = (value, info.misses)
            self.hits[id(value)] = info.hits
            return
        t = type(value)
        if t is dict or t is list:
            if len(value) > config.scan_items:
                return
            self.containers[id(value)] = (value, dict(value) if t is dict else list(value))
            for item in list(value.values() if t is dict else value):
                if type(item) in (dict, list) or isinstance(item, functools._lru_cache_wrapper):
                    self.note(item, depth + 1)
            return
        if isinstance(value, types.FunctionType):  # memo containers in its defaults and closure cells
            held = [*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values()]
            for cell in value.__closure__ or ():
                try:
                    held.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    continue
            for item in held:
                if type(item) in (dict, list) or isinstance(item, functools._lru_cache_wrapper):
                    self.note(item, depth + 1)
            if is_user_code(value.__code__):  # its attributes (`log.last = n`, `f.cache = {}`): user state
                self.note(value.__dict__, depth)
            return
        if isinstance(value, types.ModuleType):
            if not value.__name__.startswith(("torch", "numpy", "stampout")) and is_user_module(value):
                self.note(value.__dict__, depth)
            return
        fields = getattr(value, "__dict__", None)
        if type(fields) is dict and not callable(value) and not isinstance(value, (torch.Tensor, torch.nn.Module)):
            for item in list(fields.values())[:config.scan_items]:  # memos an object keeps
                if type(item) in (dict, list) or isinstance(item, functools._lru_cache_wrapper):
                    self.note(item, depth + 1)
            return
        if isinstance(value, type) and is_user_class(value):
            for klass in value.__mro__[:-1]:
                if id(klass) not in self.classes and is_user_class(klass):
                    self.classes[id(klass)] = (klass, _class_state(klass))
                for item in list(vars(klass).values()):
                    item = item.__func__ if isinstance(item, (staticmethod, classmethod)) else item
                    if type(item) in (dict, list) or isinstance(item, functools._lru_cache_wrapper):
                        self.note(item, depth + 1)

    def state(self) -> dict[Any, Any]:
        """What each noted container and class holds now, by identity (to tell whether a region trace changed
        it)."""
        state: dict[Any, Any] = {key: _identities(container) for key, (container, _) in self.containers.items()}
        state.update({("class", key): _class_state(klass) for key, (klass, _) in self.classes.items()})
        state.update({("setting", name): dict(fields) for name, (fields, _) in self.settings.items()})
        return state

    def classes_changed(self, state: dict[Any, Any] | None = None) -> list[str]:
        """`Class.attr` of each attribute of a user class rebound, added or deleted since `state` (else since the
        class was noted): `type(self).calls += 1`, `Config.last = n`."""
        changed = []
        for key, (klass, noted) in self.classes.items():
            then = noted if state is None else state.get(("class", key), noted)
            now = _class_state(klass)
            changed += [f"{klass.__qualname__}.{k}" for k in dict.fromkeys([*then, *now])
                        if then.get(k, _GONE) is not now.get(k, _GONE)]
        return changed

    def traced_class_attributes(self) -> list[str]:
        """`Class.attr` of each attribute of a user class the program rebound to a value holding a fake tensor or
        a symbolic size, each put back as noted (a class attribute is no place a capture's stores repeat)."""
        found = []
        for klass, noted in self.classes.values():
            for k, v in list(_class_state(klass).items()):
                if noted.get(k, _GONE) is not v and holds_fake(v, whole=True):
                    found.append(f"{klass.__qualname__}.{k}")
                    if k in noted:
                        type.__setattr__(klass, k, noted[k])
                    else:
                        type.__delattr__(klass, k)
        return found

    def put_back_classes(self) -> None:
        """The user classes' attributes as they were when noted (the capture's writes undone)."""
        for klass, noted in self.classes.values():
            now = _class_state(klass)
            for k in [k for k in now if k not in noted]:
                type.__delattr__(klass, k)
            for k, v in noted.items():
                if now.get(k, _GONE) is not v:
                    type.__setattr__(klass, k, v)

    def changed_since(self, state: dict[Any, Any]) -> list[str]:
        """The containers (module globals, memo dicts and lists) whose items changed since `state` (those noted
        since: since they were noted), by name where a module's globals."""
        changed = []
        for key, (container, before) in self.containers.items():
            then = state.get(key)
            if (_identities(before) if then is None else then) != _identities(container):
                name = container.get("__name__") if type(container) is dict and "__builtins__" in container else None
                changed.append(f"the globals of {name}" if name else f"a {type(container).__name__} memo")
        return (changed + [f"the class attribute {name}" for name in self.classes_changed(state)]
                + [f"the torch setting {name}" for name in self.settings_changed(state)])

    def caches_read(self) -> list[Any]:
        """The functools caches the program hit or filled since they were noted (what it got from them is a
        value its guards must keep: see CacheReads)."""
        return [w for key, (w, _) in self.caches.items() if w.cache_info().hits != self.hits.get(key)
                or w.cache_info().misses != self.caches[key][1]]

    def cached_by(self, t: torch.Tensor) -> Any:
        """The functools cache read since noted whose results hold the real tensor `t` (a hit on an entry filled
        before the capture: CacheReads keeps what each such cache holds as read), or None. (A bounded lru_cache
        keeps its results in links Python cannot look into: never found, so the program stays unguardable.)"""
        for wrapper in self.caches_read():
            if any(held is t for result in held_results(wrapper) for held in tensors_within(result)):
                return wrapper
        return None

    def cache_misses(self) -> dict[int, int]:
        return {key: wrapper.cache_info().misses for key, (wrapper, _) in self.caches.items()}

    def clear_caches(self, since: dict[int, int] | None = None, nodes: dict[int, Any] | None = None) -> list[str]:
        """Take the traced values out of the caches that stored results since `since` (else since noted): a
        fake must not be handed to the next call of the function, which runs in another graph. Real results stay
        (eager keeps them: a later change of what they were computed from is not seen, as in eager). Returns the
        caches that held a value drawn at random by the graph whose `nodes` (id -> (fake, node)) are given, also
        kept in `traced_caches` (see Note: functools caches)."""
        found = []
        for key, (wrapper, noted) in self.caches.items():
            if wrapper.cache_info().misses == (noted if since is None else since.get(key, noted)):
                continue
            self.caches[key] = (wrapper, -1)  # (changed: repair looks again)
            drawn = remove_traced_results(wrapper, nodes)
            if drawn is not None and nodes is not None:
                self.filled_caches.append(wrapper)
            if drawn and nodes is not None:
                code = getattr(getattr(wrapper, "__wrapped__", None), "__code__", None)
                found.append(_name(wrapper) + (f" ({code.co_filename}:{code.co_firstlineno})" if code else ""))
        self.traced_caches.extend(found)
        return found

    def contents(self) -> list[Any]:
        """The memo containers as they are now (what a trace may have stored in them); of a module's globals,
        the tensors it holds."""
        out: list[Any] = []
        for container, _ in self.containers.values():
            if type(container) is dict and "__builtins__" in container:
                out.extend(v for v in list(container.values()) if isinstance(v, torch.Tensor))
            else:
                out.append(container)
        return out

    def graph_values(self, nodes: dict[int, Any], extra: list[Any]) -> list[tuple[Any, Any, Place]]:
        """Fake tensors of the outer graph (`nodes`) that a memo container or a module's globals holds, as
        (container, key, Place.ITEM), each appended to `extra`: the capture stores their real values, as eager
        leaves them."""
        found = []
        clean: dict[int, Any] = {}  # (see structure's Note: clean objects)
        for container, _ in self.containers.values():
            items = container.items() if type(container) is dict else enumerate(container)
            for key, value in list(items):
                if type(value) is FakeTensor and id(value) in nodes:
                    found.append((container, key, Place.ITEM))
                    extra.append(value)
                elif type(value) not in ATOMIC and holds_fake(value, tensors_only=True, whole=True, clean=clean):
                    for holder, name, kind, fake in fake_places(value):
                        if id(fake) in nodes:
                            found.append((holder, name, kind))  # (inside an object: `G = Hidden(h)`)
                            extra.append(fake)
        return found

    def repair(self) -> Repairs:
        """Undo what put a fake where user state keeps it: traced results are taken out of the caches (see Note:
        functools caches); a dict item or list holding a fake is put back as it was
        (a symbolic size alone becomes its value for the capture's inputs, as eager would have stored it). With
        STAMPOUT_CHECK_WORLD, what it walked without finding one is kept for check_left_over, which comes next
        (nothing between them adds a traced value): it walks the rest."""
        repairs = Repairs()
        repairs.caches.extend(self.clear_caches())
        repairs.places.extend(self.rebound_cells())
        known = self.containers

        clean: dict[int, Any] = {}  # (see structure's Note: clean objects; the repairs below only take fakes out)

        def traced(key: Any, value: Any) -> bool:  # (an item that is a container of its own snapshot: on its own)
            return id(value) not in known and (holds_fake(value, whole=True, clean=clean)
                                               or holds_fake(key, whole=True, clean=clean))

        for container, before in known.values():
            items = container.items() if type(container) is dict else enumerate(container)
            if not any(traced(k, v) for k, v in list(items)):
                continue
            if type(container) is dict:
                name = container.get("__name__") if "__builtins__" in container else None
                for k in [k for k, v in container.items() if traced(k, v)]:
                    if not holds_fake(k, whole=True) and not holds_fake(container[k], tensors_only=True, whole=True):
                        container[k] = concrete(container[k])
                    elif k in before and before[k] is container[k]:  # changed inside: its own parts are put back
                        continue
                    elif k in before and not holds_fake(before[k], whole=True):
                        container[k] = before[k]
                    else:
                        del container[k]
                    repairs.places.append(f"{name}.{k}" if name else f"the item {k!r} of a dict")
            else:
                container[:] = before
                repairs.places.append("the items of a list")
        self.walked_clean = clean if config.check_world else {}
        return repairs


def check_left_over(snapshot: Snapshot, objects: list[Any]) -> None:
    """With STAMPOUT_CHECK_WORLD=1 (the test suite sets it): raise if a fake tensor or symbolic size is still
    reachable from the user state a capture touched, after the repairs (a bug in them, never silent)."""
    if not config.check_world:
        return
    places = [("a memo container", c) for c, _ in snapshot.containers.values()]
    places += [(f"{type(o).__name__}.__dict__", getattr(o, "__dict__", None)) for o in objects]
    clean, snapshot.walked_clean = snapshot.walked_clean, {}  # (see structure's Note: clean objects)
    for label, place in places:
        if isinstance(place, dict):
            bad = [k for k, v in list(place.items())
                   if holds_fake(v, whole=True, clean=clean) or holds_fake(k, whole=True, clean=clean)]
        elif isinstance(place, list):
            bad = [i for i, v in enumerate(place) if holds_fake(v, whole=True, clean=clean)]
        else:
            continue
        if bad:
            raise AssertionError(f"stampout left traced values in {label}: {bad[:5]}")


@dataclass
class Repairs:
    """What `Snapshot.repair` put right: functools caches cleared, and places that held traced values."""

    caches: list[str] = field(default_factory=list)
    places: list[str] = field(default_factory=list)

    def describe(self) -> str:
        parts = [f"the traced value it stored in {', '.join(self.places)}"] if self.places else []
        if self.caches:
            parts.append(f"the cache of {', '.join(self.caches)}")
        return " and ".join(parts)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # (an empty cell: a variable not bound yet)
        return _GONE


def _cells(fn: Any) -> dict[str, Any]:
    """What `fn`'s closure cells hold, by free variable name (empty cells left out)."""
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    out: dict[str, Any] = {}
    for name, cell in zip(code.co_freevars if code is not None else (), closure):
        try:
            out[name] = cell.cell_contents
        except ValueError:
            continue
    return out
