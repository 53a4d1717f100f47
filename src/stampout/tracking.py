"""Recording reads and writes of object attributes while a region is traced.

Module and object attributes are invisible to a TorchFunctionMode. To guard what a region read, a watched
object's class is swapped for a cached shim subclass (same name, no extra slots) whose `__getattribute__`,
`__getattr__` and `__setattr__` report to the listener. `isinstance` and `super()` keep working;
`type(obj) is Cls` does not while the capture runs. Every swap is undone when the capture ends.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from .context import _STATE
from .regions.code import is_user_code
from .sources import MISSING

# Names nn.Module and Python read internally on every call; never guarded. (`forward` is guarded: a
# per-instance forward replaces what a module computes.)
_INTERNAL = frozenset(torch.nn.Module().__dict__) - {"training"}
_SHIMS: dict[type, type] = {}


def _quiet(name: str) -> bool:
    return name.startswith("__") or name in _INTERNAL


def _from_user_code() -> bool:
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


def _make_shim(cls: type) -> type:
    orig_getattribute = cls.__getattribute__
    orig_getattr = getattr(cls, "__getattr__", None)
    orig_setattr = cls.__setattr__
    orig_delattr = cls.__delattr__
    state = _STATE

    def __getattribute__(self, name):
        value = orig_getattribute(self, name)
        ctx = state.ctx
        if ctx is not None and ctx.read is not None:
            if not _quiet(name) or name == "__dict__" and _from_user_code():
                ctx.read(self, name, value)
        return value

    def __getattr__(self, name):
        try:
            if orig_getattr is None:
                raise AttributeError(f"'{cls.__name__}' object has no attribute '{name}'")
            value = orig_getattr(self, name)
        except AttributeError:
            ctx = state.ctx
            if ctx is not None and ctx.read is not None and not _quiet(name):
                ctx.read(self, name, MISSING)
            raise
        ctx = state.ctx
        if ctx is not None and ctx.read is not None and not _quiet(name):
            ctx.read(self, name, value)
        return value

    def __setattr__(self, name, value):
        ctx = state.ctx
        if ctx is None or ctx.write is None or _quiet(name):
            orig_setattr(self, name, value)
            return
        old = peek(self, name)
        orig_setattr(self, name, value)
        ctx.write(self, name, value, old)

    def __delattr__(self, name):
        ctx = state.ctx
        if ctx is None or ctx.write is None or _quiet(name):
            orig_delattr(self, name)
            return
        old = peek(self, name)
        orig_delattr(self, name)
        ctx.write(self, name, MISSING, old)

    namespace = {
        "__slots__": (),
        "__getattribute__": __getattribute__,
        "__getattr__": __getattr__,
        "__setattr__": __setattr__,
        "__delattr__": __delattr__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "_stampout_original": cls,
    }
    return type(cls)(cls.__name__, (cls,), namespace)


def _cached_shim(cache: dict[type, type | None], make: Callable[[type], type], cls: type) -> type | None:
    """`make(cls)`, made once per class; None when the class cannot be subclassed that way."""
    if cls not in cache:
        try:
            cache[cls] = make(cls)
        except TypeError:
            cache[cls] = None
    return cache[cls]


def shim_class(cls: type) -> type | None:
    """The cached read-and-write tracking subclass of `cls`, or None when `cls` cannot be shimmed."""
    return _cached_shim(_SHIMS, _make_shim, cls)


def original_class(obj: Any) -> type:
    cls = type(obj)
    return cls.__dict__.get("_stampout_original", cls)


class Swaps:
    """Objects whose class one owner swapped for a shim (`shim_for(original class)`); `restore()` undoes it.

    An object already carrying another shim (a compiled function's write shim during a capture, say) is
    given this owner's shim of the original class and gets its previous class back on restore."""

    def __init__(self, shim_for: Callable[[type], type | None]) -> None:
        self._shim_for = shim_for
        self._swapped: dict[int, tuple[Any, type]] = {}

    def __contains__(self, obj: Any) -> bool:
        return id(obj) in self._swapped

    def watch(self, obj: Any) -> bool:
        """Swap `obj` to the shim; False when its class does not allow it."""
        if id(obj) in self._swapped:
            return True
        previous = _swap(obj, self._shim_for)
        if previous is None:
            return False
        self._swapped[id(obj)] = (obj, previous)
        return True

    def restore(self) -> None:
        for obj, cls in reversed(list(self._swapped.values())):
            _set_class(obj, cls)
        self._swapped.clear()


class Watch(Swaps):
    """Read watching for one capture; `arguments` holds the ids of objects passed to region calls."""

    def __init__(self) -> None:
        super().__init__(shim_class)
        self.arguments: set[int] = set()


def _swap(obj: Any, shim_for: Callable[[type], type | None]) -> type | None:
    """Give `obj` the shim of its original class; its class before, or None when that is not possible."""
    cls = type(obj)
    shim = shim_for(cls.__dict__.get("_stampout_original", cls))
    if shim is None:
        return None
    try:
        _set_class(obj, shim)
    except TypeError:
        return None
    return cls


def _set_class(obj: Any, cls: type) -> None:
    # nn.Module.__setattr__ would route `__class__` through its own logic; go straight to object's.
    object.__setattr__(obj, "__class__", cls)


# ---- write watching: invalidating cached guard state when a watched attribute is written --------------
class _Epoch:
    """A counter bumped by every write to a watched object; compiled guards re-check only when it moved."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def bump(self, *_: Any) -> None:
        self.value += 1


EPOCH = _Epoch()
_WRITE_SHIMS: dict[type, type | None] = {}
_HOOK_METHODS = ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
                 "register_full_backward_pre_hook", "register_backward_hook")


def _make_write_shim(cls: type) -> type:
    orig_setattr = cls.__setattr__
    orig_delattr = cls.__delattr__
    epoch = EPOCH

    def __setattr__(self, name, value):
        orig_setattr(self, name, value)
        epoch.value += 1

    def __delattr__(self, name):
        orig_delattr(self, name)
        epoch.value += 1

    namespace: dict[str, Any] = {
        "__slots__": (),
        "__setattr__": __setattr__,
        "__delattr__": __delattr__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "_stampout_original": cls,
    }
    if issubclass(cls, torch.nn.Module):
        for method in _HOOK_METHODS:
            namespace[method] = _bumping(getattr(cls, method))
    return type(cls)(cls.__name__, (cls,), namespace)


def _bumping(register: Callable) -> Callable:
    def wrapper(self, *args, **kwargs):
        handle = register(self, *args, **kwargs)
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


def write_shim_class(cls: type) -> type | None:
    """The cached write-watching subclass of `cls`, or None when `cls` cannot be shimmed."""
    return _cached_shim(_WRITE_SHIMS, _make_write_shim, cls)


_WRITE_WATCHERS: dict[int, list[Any]] = {}  # id(obj) -> [obj, class before, number of WriteWatches]


class WriteWatch:
    """Objects whose writes bump EPOCH while a compiled function guards them; `release()` undoes it.

    Several compiled functions may watch one object (a model and one of its layers): the write shim
    stays until the last of them releases it."""

    def __init__(self) -> None:
        self._mine: set[int] = set()

    def __contains__(self, obj: Any) -> bool:
        return id(obj) in self._mine

    def watch(self, obj: Any) -> bool:
        if id(obj) in self._mine:
            return True
        shared = _WRITE_WATCHERS.get(id(obj))
        if shared is None:
            previous = _swap(obj, write_shim_class)
            if previous is None:
                return False
            shared = _WRITE_WATCHERS[id(obj)] = [obj, previous, 0]
            if isinstance(obj, torch.nn.Module):
                _bumping_registries(obj, _BumpingDict)
        shared[2] += 1
        self._mine.add(id(obj))
        return True

    def release(self) -> None:
        for key in self._mine:
            shared = _WRITE_WATCHERS[key]
            shared[2] -= 1
            if shared[2] == 0:
                _set_class(shared[0], shared[1])
                if isinstance(shared[0], torch.nn.Module):
                    _bumping_registries(shared[0], dict)
                del _WRITE_WATCHERS[key]
        self._mine.clear()
        EPOCH.bump()


class _BumpingDict(dict):
    """A module's `_parameters`/`_buffers`/`_modules` while watched: direct item writes
    (`module._parameters["weight"] = p`, as loaders and `_apply` do) bypass `__setattr__` but bump EPOCH."""

    __slots__ = ()

    def __setitem__(self, key, value):
        dict.__setitem__(self, key, value)
        EPOCH.value += 1

    def __delitem__(self, key):
        dict.__delitem__(self, key)
        EPOCH.value += 1

    def _bump_after(name: str):  # noqa: N805  (builds methods below)
        method = getattr(dict, name)

        def bumped(self, *args, **kwargs):
            out = method(self, *args, **kwargs)
            EPOCH.value += 1
            return out

        bumped.__name__ = name
        return bumped

    pop = _bump_after("pop")
    popitem = _bump_after("popitem")
    clear = _bump_after("clear")
    update = _bump_after("update")
    setdefault = _bump_after("setdefault")
    __ior__ = _bump_after("__ior__")
    del _bump_after


_REGISTRIES = ("_parameters", "_buffers", "_modules")


def _bumping_registries(module: torch.nn.Module, kind: type) -> None:
    """Give `module` registries of class `kind` (same contents) in place of its current ones."""
    d = module.__dict__
    for name in _REGISTRIES:
        registry = d.get(name)
        if isinstance(registry, dict) and type(registry) is not kind:
            d[name] = kind(registry)


def _registration_hook(module: Any, *_: Any) -> None:
    if id(module) in _WRITE_WATCHERS:  # only a watched module's registrations can change what was guarded
        EPOCH.bump()


_REGISTRATION_HOOKS: list[Any] = []


def install_registration_hooks() -> None:
    """Parameter, buffer and submodule registration (which bypasses `__setattr__`) bumps EPOCH too."""
    if not _REGISTRATION_HOOKS:
        m = torch.nn.modules.module
        _REGISTRATION_HOOKS.extend([
            m.register_module_parameter_registration_hook(_registration_hook),
            m.register_module_buffer_registration_hook(_registration_hook),
            m.register_module_module_registration_hook(_registration_hook),
        ])
