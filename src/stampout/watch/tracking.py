"""Recording reads and writes of object attributes: while a capture runs (`Watch`), and while a compiled
function guards objects (`WriteWatch`).

Module and object attributes are invisible to a TorchFunctionMode. A watched object's class is patched in
place (see classpatch.py); where that is impossible the object's class is swapped for a cached shim
subclass (same name, no extra slots) with the same reporting methods. Everything is undone when the capture
ends or the compiled function lets go.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ..trace.frames import python_hooks_off
from . import classpatch
from .classpatch import EPOCH, READ_IDS, WRITE_IDS, Need

_SHIMS: dict[type, type | None] = {}


def _make_shim(cls: type) -> type:
    """A subclass of `cls` carrying the same reporting methods as a class patch (classpatch.wrappers): for
    objects whose own class cannot be patched. What it reports depends on READ_IDS and WRITE_IDS."""
    namespace = {
        "__slots__": (),
        **classpatch.wrappers(cls),
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "_stampout_original": cls,
    }
    with python_hooks_off():  # (the class's `__init_subclass__` and metaclass run for stampout, not the program)
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


class Watch:
    """Read watching for one capture (reads and writes of watched objects go to the capture's listeners).

    An object's class is patched in place (`classpatch`); where that is impossible (C types such as
    SimpleNamespace, or a plain `nn.Module`) the object's class is swapped for a cached shim subclass for
    the duration of the capture. `arguments` holds the ids of objects passed to region calls."""

    def __init__(self) -> None:
        self._objects: dict[int, tuple[Any, type | None]] = {}  # id -> (object, class swapped from | None)
        self.arguments: set[int] = set()

    def __contains__(self, obj: Any) -> bool:
        return id(obj) in self._objects

    def watch(self, obj: Any) -> bool:
        """Watch `obj`; False when neither its class nor the object allows it."""
        key = id(obj)
        if key in self._objects:
            return True
        cls = type(obj)
        if classpatch.acquire(cls, Need.READ):
            self._objects[key] = (obj, None)
            READ_IDS.add(key)
            return True
        previous = _swap(obj, shim_class)
        if previous is None:
            return False
        self._objects[key] = (obj, previous)
        READ_IDS.add(key)
        return True

    def objects(self) -> list[Any]:
        return [obj for obj, _ in self._objects.values()]

    def restore(self) -> None:
        for key, (obj, previous) in reversed(list(self._objects.items())):
            READ_IDS.discard(key)
            if previous is None:
                classpatch.release(type(obj), Need.READ)
            else:
                _set_class(obj, previous)
        self._objects.clear()


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
_WRITE_WATCHERS: dict[int, list[Any]] = {}  # id(obj) -> [obj, class swapped from | None, number of watchers]


class WriteWatch:
    """Objects whose writes bump EPOCH while a compiled function guards them; `release()` undoes it.

    Like read watching, by patching the object's class in place (a shim subclass where that is impossible).
    Several compiled functions may watch one object (a model and one of its layers): the watch stays until
    the last of them releases it."""

    def __init__(self) -> None:
        self._mine: set[int] = set()

    def __contains__(self, obj: Any) -> bool:
        return id(obj) in self._mine

    def watch(self, obj: Any) -> bool:
        key = id(obj)
        if key in self._mine:
            return True
        shared = _WRITE_WATCHERS.get(key)
        if shared is None:
            if classpatch.acquire(type(obj), Need.WRITE):
                previous = None
            else:
                previous = _swap(obj, shim_class)
                if previous is None:
                    return False
            shared = _WRITE_WATCHERS[key] = [obj, previous, 0]
            WRITE_IDS[key] = 1
            if isinstance(obj, torch.nn.Module):
                _bumping_registries(obj, _BumpingDict)
                _bumping_hooks(obj, True)
        shared[2] += 1
        self._mine.add(key)
        return True

    def release(self) -> None:
        for key in self._mine:
            shared = _WRITE_WATCHERS[key]
            shared[2] -= 1
            if shared[2] == 0:
                obj, previous = shared[0], shared[1]
                if previous is None:
                    classpatch.release(type(obj), Need.WRITE)
                else:
                    _set_class(obj, previous)
                if isinstance(obj, torch.nn.Module):
                    _bumping_registries(obj, dict)
                    _bumping_hooks(obj, False)
                del _WRITE_WATCHERS[key]
                WRITE_IDS.pop(key, None)
        self._mine.clear()
        EPOCH.bump()


def _bumping(base: type, names: tuple[str, ...]) -> dict[str, Callable]:
    """`base`'s methods `names`, each bumping EPOCH after it writes."""
    def bumping(method: Callable) -> Callable:
        def bumped(self, *args, **kwargs):
            out = method(self, *args, **kwargs)
            EPOCH.value += 1
            return out

        bumped.__name__ = method.__name__
        return bumped

    return {name: bumping(getattr(base, name)) for name in names}


_WRITES = ("pop", "popitem", "clear", "update", "setdefault", "__ior__")


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

    locals().update(_bumping(dict, _WRITES))


class _BumpingHooks(OrderedDict):
    """An empty hook dict of a watched module (see `_bumping_hooks`): a hook stored straight into it
    (`module._forward_hooks[k] = fn`, no `register_forward_hook` call) bumps EPOCH."""

    __slots__ = ()
    locals().update(_bumping(OrderedDict, ("__setitem__", "__delitem__", "move_to_end", *_WRITES)))

    def __reduce__(self):  # (pickled and copied as the OrderedDict torch made)
        return OrderedDict, (list(self.items()),)


_REGISTRIES = ("_parameters", "_buffers", "_modules")


def _bumping_registries(module: torch.nn.Module, kind: type) -> None:
    """Give `module` registries of class `kind` (same contents) in place of its current ones."""
    d = module.__dict__
    for name in _REGISTRIES:
        registry = d.get(name)
        if isinstance(registry, dict) and type(registry) is not kind:
            d[name] = kind(registry)


# The hook dicts whose emptiness a module call tests (`_call_impl` runs hooks when one is not empty; their hooks are
# what a hooks guard compares: guards/hook_keys.py). The guard that found them empty is checked only after a write
# to a watched module, so an empty one is swapped for a _BumpingHooks while the module is watched (and back, while
# still empty, when it is let go). A non-empty one stays: its hooks are guarded on every call (protection.py), and
# their handles hold that dict (weakly) to remove them from.
HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _bumping_hooks(module: torch.nn.Module, watched: bool) -> None:
    d = module.__dict__
    for name in HOOK_DICTS:
        hooks = d.get(name)
        if watched and type(hooks) is OrderedDict and not hooks:
            d[name] = _BumpingHooks()
        elif not watched and type(hooks) is _BumpingHooks and not hooks:
            d[name] = OrderedDict()


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
