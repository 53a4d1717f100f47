"""Watching attribute reads and writes of chosen instances by patching their classes in place.

A watched object's class gets `__getattribute__`, `__getattr__`, `__setattr__` and `__delattr__` (and, for
modules, the hook registration methods) that behave as before and, for watched instances only, report to
the capture running on this thread (reads and writes) or bump the compiled functions' epoch (writes).
The object keeps its class: `type(m) is Cls`, pickling and `torch.nn.utils.parametrize` see the user's
class. A class is patched while any of its instances is watched and restored when the last one is not.
Classes that cannot be patched (C types such as SimpleNamespace, and `nn.Module` itself, which every
module inherits from) are left alone: the caller falls back to another way, or to not watching.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..context import STATE
from ..sources import MISSING
from ..trace.code import is_user_code
from ..trace.constants import same_constant

READ_IDS: set[int] = set()  # instances whose reads and writes the capture on the owning thread records
WRITE_IDS: dict[int, int] = {}  # instances whose writes bump EPOCH -> number of watchers


class _Epoch:
    """A counter bumped by every write to a watched object; compiled guards re-check only when it moved."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def bump(self, *_: Any) -> None:
        self.value += 1


EPOCH = _Epoch()
# Names nn.Module and Python read internally on every call; never guarded. (`forward` is guarded: a
# per-instance forward replaces what a module computes.)
INTERNAL = frozenset(torch.nn.Module().__dict__) - {"training"}
_HOOK_METHODS = ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
                 "register_full_backward_pre_hook", "register_backward_hook")
_UNPATCHABLE = (object, torch.nn.Module)
PATCHED_NAMES = frozenset(("__getattribute__", "__getattr__", "__setattr__", "__delattr__", *_HOOK_METHODS))


def quiet(name: str) -> bool:
    return name.startswith("__") or name in INTERNAL


def from_user_code() -> bool:
    """Whether the attribute read happening now was written in user code (`vars(self)`, `self.__dict__`),
    not in nn.Module's or Python's own machinery."""
    frame = sys._getframe(2)
    return frame is not None and is_user_code(frame.f_code)


def peek(obj: Any, name: str) -> Any:
    """The value `obj` itself holds for `name` (its dict, a module's registries, a slot); MISSING if none
    (a class-level default does not count: deleting the instance's value restores it)."""
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        if name in d:
            return d[name]
        for registry in ("_parameters", "_buffers", "_modules"):
            r = d.get(registry)
            if isinstance(r, dict) and name in r:
                return r[name]
    for klass in type(obj).__mro__:
        slot = klass.__dict__.get(name)
        if slot is not None:
            if type(slot).__name__ == "member_descriptor":
                try:
                    return slot.__get__(obj, type(obj))
                except AttributeError:
                    return MISSING
            break
    return MISSING


# The constants whose equal store (`same_constant`, the guards' rule) counts as no write. (same_constant would take
# floats and tuples too: an int, a str or a flag is what programs store again per call.)
_PLAIN = frozenset({int, str, bool, bytes})


def keeps(obj: Any, name: str, value: Any) -> bool:
    """Whether storing `value` as `obj.name` leaves it as it is: the instance's own dict already holds that object,
    or an equal int/str/bool/bytes of its type (`self._previous_max_cache_length = n`, which transformers' generate
    stores on every call), and no data descriptor of the class takes the store."""
    d = getattr(obj, "__dict__", None)
    if not isinstance(d, dict) or name not in d:
        return False
    old = d[name]
    if not (old is value or type(value) in _PLAIN and same_constant(old, value)):
        return False
    for klass in type(obj).__mro__:
        if name in klass.__dict__:
            return not hasattr(type(klass.__dict__[name]), "__set__")
    return True


class Need(enum.Enum):
    """Why an instance is watched: which part of its class's patch it needs."""

    READ = "read"  # reads and writes reported to the capture on this thread (__getattribute__, __getattr__ too)
    WRITE = "write"  # writes bump EPOCH while a compiled function guards it


class _Patch:
    """One patched class: what its dict held before, and how many watched instances need each part (reads
    are reported only during a capture; writes bump the epoch while a compiled function watches)."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.saved: dict[str, Any] = {}
        self.users = {Need.READ: 0, Need.WRITE: 0}


_PATCHES: dict[type, _Patch] = {}


def original(cls: type, name: str) -> Any:
    """`cls.name` as it resolves without any of stampout's patches."""
    for klass in cls.__mro__:
        patch = _PATCHES.get(klass)
        own = patch.saved.get(name, MISSING) if patch is not None and name in patch.saved \
            else klass.__dict__.get(name, MISSING)
        if own is not MISSING:
            return own
    return None


def shimmed(cls: type, name: str) -> tuple[bool, Any]:
    """(True, what `cls`'s own dict held before) while stampout's patch holds `cls.name` (MISSING: nothing)."""
    patch = _PATCHES.get(cls)
    if patch is not None and name in patch.saved:
        return True, patch.saved[name]
    return False, None


def patched_classes() -> list[type]:
    """The classes stampout's patch holds now (its attribute watch: during captures, and while compiled functions
    watch writes)."""
    return list(_PATCHES)


def wrappers(cls: type) -> dict[str, Any]:
    orig_getattribute = original(cls, "__getattribute__")
    orig_getattr = original(cls, "__getattr__")
    orig_setattr = original(cls, "__setattr__")
    orig_delattr = original(cls, "__delattr__")
    state, read_ids, write_ids, epoch = STATE, READ_IDS, WRITE_IDS, EPOCH

    def __getattribute__(self, name):
        value = orig_getattribute(self, name)
        ctx = state.ctx
        if ctx is not None and ctx.read is not None and id(self) in read_ids:
            if not quiet(name) or name == "__dict__" and from_user_code():
                instead = ctx.read(self, name, value)
                if instead is not None:  # a per-layer index the trace follows (regions/slots.py)
                    return instead
            elif name == "__getstate__" and getattr(type(self), name, None) is _DEFAULT_GETSTATE:
                read_state(ctx.read, self)
        return value

    def __getattr__(self, name):
        try:
            if orig_getattr is None:
                raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
            value = orig_getattr(self, name)
        except AttributeError:
            ctx = state.ctx
            if ctx is not None and ctx.read is not None and id(self) in read_ids and not quiet(name):
                ctx.read(self, name, MISSING)
            raise
        ctx = state.ctx
        if ctx is not None and ctx.read is not None and id(self) in read_ids and not quiet(name):
            ctx.read(self, name, value)
        return value

    def _store(store: Callable, self: Any, name: str, args: tuple) -> None:
        key = id(self)
        kept = key in write_ids and args and keeps(self, name, args[0])  # (guards need no re-check then)
        ctx = state.ctx
        if ctx is not None and ctx.write is not None and key in read_ids and not quiet(name):
            old = peek(self, name)
            store(self, name, *args)
            ctx.write(self, name, args[0] if args else MISSING, old)
        else:
            store(self, name, *args)
        if key in write_ids and not kept:
            epoch.value += 1

    def __setattr__(self, name, value):
        _store(orig_setattr, self, name, (value,))

    def __delattr__(self, name):
        _store(orig_delattr, self, name, ())

    out = {"__getattribute__": __getattribute__, "__getattr__": __getattr__, "__setattr__": __setattr__,
           "__delattr__": __delattr__}
    if issubclass(cls, torch.nn.Module):
        for method in _HOOK_METHODS:
            out[method] = _bumping(original(cls, method))
    return out


def _bumping(register: Callable) -> Callable:
    def wrapper(self, *args, **kwargs):
        handle = register(self, *args, **kwargs)
        if id(self) in WRITE_IDS:
            EPOCH.bump()
            remove = handle.remove

            def remove_and_bump() -> None:
                remove()
                EPOCH.bump()

            handle.remove = remove_and_bump
        return handle

    wrapper.__name__ = register.__name__
    wrapper.__doc__ = register.__doc__
    return wrapper


# Note: the state C code reads whole
# `copy.copy`, `copy.deepcopy` and pickling call `object.__reduce_ex__`, which hands the instance's `__dict__` to
# C through `object.__getstate__` without reading one attribute: each field would be copied unseen (a copy of a
# config whose field changed later). Its lookup of `__getstate__` comes through the patched `__getattribute__`:
# there every field is reported read. (A class's own `__getstate__` is Python reading attributes: seen as is.)
_DEFAULT_GETSTATE = object.__getstate__


def read_state(read: Callable, obj: Any) -> None:
    """Report each field of `obj`'s `__dict__` read (see Note: the state C code reads whole)."""
    try:
        fields = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return
    for name, value in list(fields.items()) if type(fields) is dict else ():
        if not quiet(name):
            read(obj, name, value)


def patchable(cls: type) -> bool:
    return cls not in _UNPATCHABLE and "_stampout_original" not in cls.__dict__


_READ_NAMES = ("__getattribute__", "__getattr__")


def acquire(cls: type, kind: Need) -> bool:
    """Patch `cls` for one more watched instance; False when it cannot be."""
    patch = _PATCHES.get(cls)
    if patch is None:
        if not patchable(cls):
            return False
        patch = _Patch(cls)
        if not _install(patch, [n for n in wrappers(cls) if n not in _READ_NAMES]):
            return False
        _PATCHES[cls] = patch
    if kind is Need.READ and patch.users[Need.READ] == 0 and not _install(patch, list(_READ_NAMES)):
        if not any(patch.users.values()):
            _restore(patch, list(patch.saved))
            del _PATCHES[cls]
        return False
    patch.users[kind] += 1
    return True


def release(cls: type, kind: Need) -> None:
    patch = _PATCHES.get(cls)
    if patch is None:
        return
    patch.users[kind] -= 1
    if kind is Need.READ and patch.users[Need.READ] <= 0:
        _restore(patch, list(_READ_NAMES))
    if not any(n > 0 for n in patch.users.values()):
        _restore(patch, list(patch.saved))
        del _PATCHES[cls]


def _install(patch: _Patch, names: list[str]) -> bool:
    cls = patch.cls
    made = wrappers(cls)
    try:
        for name in names:
            before = cls.__dict__.get(name, MISSING)
            type.__setattr__(cls, name, made[name])
            patch.saved[name] = before
    except TypeError:  # a C type: its dict is read-only
        _restore(patch, names)
        return False
    return True


def _restore(patch: _Patch, names: list[str]) -> None:
    for name in names:
        if name not in patch.saved:
            continue
        value = patch.saved.pop(name)
        if value is MISSING:
            if name in patch.cls.__dict__:
                type.__delattr__(patch.cls, name)
        else:
            type.__setattr__(patch.cls, name, value)


def patched_classes() -> list[type]:
    return list(_PATCHES)
