"""The world outside the watched objects, as a capture leaves it.

A capture runs the program's Python once, on fake tensors. Two things outside the objects stampout watches
are put right afterwards, whether the capture succeeded or failed:

- the random number generators the Python may have drawn from (Python's `random`, NumPy's global state,
  torch's CPU generator) are put back as they were before the capture (`RandomStates`): the capture is not a
  call, and a seeded program gives eager's numbers afterwards (the draws themselves make a trace ineligible,
  see regions/purity.py);
- no fake tensor or symbolic size stays reachable from the state the program's code could reach: here, how a
  fake is taken out of objects' attributes (`clear_fakes`; trace/structure.py's `holds_fake` finds one in a value);
  the memo caches, module globals and class dicts its code may reach are remembered and repaired by world_snapshot.py.
"""

from __future__ import annotations

import collections
import random
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch

from .. import config
from ..sources import Place
from ..torch_internals import FakeTensor
from ..trace.shapes import concrete
from ..trace.structure import ATOMIC, holds_fake, plain_object, public_names, referents, slot_fields


@dataclass
class RandomStates:
    """The states of the process-wide generators, to put back after a capture."""

    python: Any
    numpy: Any
    torch_cpu: torch.Tensor
    torch_cuda: Any = None  # (only where CUDA is initialized)

    @staticmethod
    def save() -> RandomStates:
        numpy = sys.modules.get("numpy")
        state = numpy.random.get_state(legacy=False) if numpy is not None else None
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return RandomStates(random.getstate(), state, torch.random.get_rng_state(), cuda)

    def restore(self) -> None:
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)
        torch.random.set_rng_state(self.torch_cpu)
        if self.torch_cuda is not None:
            torch.cuda.set_rng_state_all(self.torch_cuda)


@dataclass
class FieldsBefore:
    """What the objects a capture may change held before the program ran, shallowly: each object's attributes
    (not `_` ones: registries and flags), and, for each attribute value, a copy of its items (a list, dict, set or
    deque) or of its own attributes (a plain object, a function): what `clear_fakes` puts back where the program
    left a traced value it cannot account for. By id, the objects kept alive here."""

    fields: dict[int, tuple[Any, dict]]
    items: dict[int, tuple[Any, Any]]

    @staticmethod
    def take(objects: list[Any]) -> FieldsBefore:
        before = FieldsBefore({}, {})
        for obj in objects:
            before._note(obj, 0)
        return before

    def _note(self, v: Any, depth: int) -> None:
        """`v`'s attributes (an object with a __dict__) or items (a list, dict, set, deque of at most
        config.scan_items), and theirs, config.scan_depth levels deep."""
        if type(v) in ATOMIC or id(v) in self.items or id(v) in self.fields or isinstance(v, torch.Tensor):
            return  # (noted already before isinstance: a config every module holds answers `__class__` in Python)
        if type(v) in (list, set, collections.deque, dict):
            if len(v) > config.scan_items:
                return
            self.items[id(v)] = (v, dict(v) if type(v) is dict else list(v))
            inside = list(v.values() if type(v) is dict else v)
        else:
            fields = getattr(v, "__dict__", None)
            if type(fields) is not dict or not (depth == 0 or plain_object(v) or type(v) is types.FunctionType):
                return
            kept = self.fields[id(v)] = (v, {k: fields[k] for k in public_names(tuple(fields))})
            inside = kept[1].values()
        if depth < config.scan_depth:
            for x in inside:
                if type(x) not in ATOMIC:  # (a module's flags and sizes: no call for them)
                    self._note(x, depth + 1)

    def put_back_items(self, value: Any) -> bool:
        """`value`'s items as noted, if noted and none of them traced; whether it was."""
        noted = self.items.get(id(value))
        if noted is None or holds_fake(noted[1], whole=True):
            return False
        if type(value) is dict:
            value.clear()
            value.update(noted[1])
        elif type(value) is list:
            value[:] = noted[1]
        else:  # (a set, a deque)
            value.clear()
            value.extend(noted[1]) if type(value) is collections.deque else value.update(noted[1])
        return True


def clear_fakes(objects: list[Any], cleared: dict[int, Any] | None = None,
                before: FieldsBefore | None = None, clean: dict[int, Any] | None = None) -> list[str]:
    """Attributes of `objects` (modules, the call's input objects) that hold a fake tensor or a symbolic size
    written behind their `__setattr__` (`functools.cached_property`, `obj.__dict__[k] = v`, a tuple, a deque or a
    function object the watch does not see into): put back as they were before the program ran, as `before`
    noted them (an attribute rebound: its old value; a container changed in place: its old items; a plain object
    or function changed inside: its attributes, the same way); an attribute the program added: removed. Never
    the caller's attribute itself (was: deleted, so the model lost `self.steps`): one `before` cannot account for
    stays as it is, still holding the traced value, and is named all the same (capture refuses, compile runs the
    program eagerly, which stores the real value). Returns the places' names. `cleared`: the objects already
    made clean, by id (each object is walked once, so a config object that every layer holds costs one walk;
    kept alive here, so no id is reused meanwhile). `clean`: the pass's whole walks (see Note: clean objects in
    trace/structure.py; the repairs only take traced values out), so what a layer's bound `forward` reaches (the
    layer, its config) is walked once, not once per holder."""
    removed = []
    cleared = {} if cleared is None else cleared
    clean = {} if clean is None else clean
    before = FieldsBefore({}, {}) if before is None else before
    for obj in objects:
        fields = getattr(obj, "__dict__", None)
        if type(fields) is not dict or id(obj) in cleared or id(obj) in clean:  # (clean: reaches no traced value)
            continue
        cleared[id(obj)] = obj
        dirty = []
        for k in public_names(tuple(fields)):
            v = fields[k]
            if type(v) in ATOMIC or id(v) in cleared:
                continue
            if holds_fake(v, whole=True, clean=clean):
                dirty.append(k)
            elif plain_object(v):
                cleared[id(v)] = v  # (clean as found: a later holder of it need not look again)
        noted = before.fields.get(id(obj), (None, None))[1]
        for key in dirty:
            value = fields[key]
            removed.append(f"{type(obj).__name__}.{key}")
            if type(value) in (list, dict) and not holds_fake(value, tensors_only=True, whole=True):  # (sizes only)
                _concrete_items(value)
                continue
            old = _GONE if noted is None else noted.get(key, _GONE)
            if noted is not None and old is _GONE:  # (an attribute the program added)
                del fields[key]
            elif old is not value and old is not _GONE and not holds_fake(old, whole=True):  # (rebound)
                fields[key] = old
            else:  # (changed in place: its items, or its attributes, the same way)
                before.put_back_items(value)
                inside = [value] if plain_object(value) or type(value) is types.FunctionType else (
                    list(value.values() if type(value) is dict else value) if id(value) in before.items else [])
                clear_fakes(inside, cleared, before, clean)
    return removed


_GONE = object()


def _concrete_items(container: list | dict, depth: int = 0) -> None:
    """Each symbolic size in `container` (and the lists and dicts it holds) replaced by its value."""
    for key, item in list(container.items() if type(container) is dict else enumerate(container)):
        if type(item) in (list, dict) and depth < config.scan_depth:
            _concrete_items(item, depth + 1)
        elif holds_fake(item):
            container[key] = concrete(item)


def fake_places(value: Any) -> list[tuple[Any, Any, Place, Any]]:
    """Each place within `value` that holds a fake tensor and can be given its real value, as (holder, key, Place,
    fake): a dict's or list's item, a set's member, an attribute or __slots__ field, a closure cell's contents.
    What the whole walk (structure.referents) reaches otherwise (a tuple, a partial's arguments, a dict key) is
    looked into for more such places but has none itself: a fake held there stays, and the world repair takes
    out what holds it."""
    out: list[tuple[Any, Any, Place, Any]] = []
    seen: dict[int, Any] = {}
    stack = [value]
    while stack:
        v = stack.pop()
        if type(v) in ATOMIC or isinstance(v, torch.Tensor) or id(v) in seen:
            continue
        seen[id(v)] = v
        inside = referents(v)
        if not inside:
            continue
        places: list[tuple[Any, Any, Place, Any]] = []
        if type(v) in (dict, list) or isinstance(v, (dict, collections.deque)):  # (a deque takes `d[i] = t` too)
            places = [(v, k, Place.ITEM, x) for k, x in (dict.items(v) if isinstance(v, dict) else enumerate(v))]
        elif type(v) is set:
            places = [(v, x, Place.MEMBER, x) for x in v]
        elif type(v) is types.FunctionType:
            places = [(c, "cell_contents", Place.ATTR, x) for c in v.__closure__ or () for x in referents(c)]
        else:
            fields = getattr(v, "__dict__", None)
            if type(fields) is dict:
                places = [(v, k, Place.ATTR, x) for k, x in fields.items()]
            for klass in type(v).__mro__:
                for name in slot_fields(klass):
                    if hasattr(v, name):
                        places.append((v, name, Place.ATTR, getattr(v, name)))
        for place in places:
            if type(place[3]) is FakeTensor:
                out.append(place)
        stack.extend(reversed([x for x in inside if type(x) is not FakeTensor]))
    return out
