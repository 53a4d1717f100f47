"""Names a trace resolved in namespaces (module `__dict__`s, `torch.Tensor`'s class dict), guarded by identity.

# Note: why one record per trace, checked by dict versions
A program reads dozens of `torch.*` / `F.*` / `math.*` names; a guard per name would make every call pay for
each. CPython bumps a dict's version tag on every write, so one C++ check (`dict_sentinel`) over the few
namespace dicts says "nothing was rebound" in a fixed cost. Only when a dict moved are the names compared one
by one (and the sentinel re-armed if they all still hold): `F.gelu = my_gelu` fails the guard, an unrelated
write to `torch.__dict__` costs one re-check.
"""

from __future__ import annotations

import gc
import os
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..sources import MISSING
from ..torch_internals import TensorBase, dict_sentinel
from ..trace.code import is_user_file
from ..watch.classpatch import patched_classes, shimmed
from .values import same_constant

_MISSING = object()
ABSENT_NAME = _MISSING  # noted as a name's value: the name must stay absent (a subclass must not shadow a base's)


def class_dict(cls: type) -> dict:
    """The dict behind a class's `__dict__` mappingproxy (writes to the class go through it)."""
    d = gc.get_referents(cls.__dict__)[0]
    key = id(d)
    if key not in _OWNERS:
        _OWNERS[key] = weakref.ref(cls, lambda _, key=key: _OWNERS.pop(key, None))
    return d


# id of a class dict class_dict returned -> its class (see _modified); an entry leaves with its class
_OWNERS: dict[int, weakref.ref] = {}


def _modified(namespace: dict) -> None:
    """A class dict written directly: CPython's type attribute cache still answers `Cls.name` with the old value
    until the class is modified through `type.__setattr__` (a metaclass's `Counting.made` read 1 after the capture
    put back 0). A set and delete of a private name invalidates it for the class and its subclasses."""
    ref = _OWNERS.get(id(namespace))
    cls = ref() if ref is not None else None
    if cls is None or gc.get_referents(cls.__dict__)[0] is not namespace:
        return
    try:
        type.__setattr__(cls, "_stampout_modified", None)
        type.__delattr__(cls, "_stampout_modified")
    except TypeError:  # (a static builtin type: never written by a program either)
        pass


def same_mros(mros: list[tuple[type, tuple]]) -> bool:
    """Each class still has the `__mro__` tuple it had (class, its MRO then): a `__bases__` assignment makes a new
    one, which no dict version shows."""
    for cls, mro in mros:
        if cls.__mro__ is not mro:
            return False
    return True


TENSOR_DICT = class_dict(torch.Tensor)  # `torch.Tensor.add = patched` writes here


def patched_tensor_methods() -> list[str]:
    """`torch.Tensor` methods replaced by user functions (`torch.Tensor.add = my_add`): torch dispatches its
    own calls of such a method to the replacement, so a trace of them records the wrong function."""
    base = TensorBase
    return [name for name, value in TENSOR_DICT.items()
            if hasattr(base, name) and callable(value) and is_user_file(getattr(getattr(value, "__code__", None),
                                                                                "co_filename", "<torch"))]


def _beneath_shim(namespace: dict, name: str) -> Any:
    """What `namespace[name]` holds beneath stampout's own attribute watch, where `namespace` is the dict of a class
    it patches now (a class noted before the watch patched it, later in the same capture: `nn.Linear.__getattr__`
    once a plain Linear is watched after a subclass's lookups were noted), else what it holds."""
    for cls in patched_classes():
        patched, own = shimmed(cls, name)
        if patched and class_dict(cls) is namespace:
            return _MISSING if own is MISSING else own
    return namespace.get(name, _MISSING)


def _moved(namespace: dict, name: str, value: Any) -> bool:
    """Whether a looked-up name no longer holds `value`, beneath stampout's own attribute watch (_beneath_shim, asked
    only where the plain lookup differs)."""
    return namespace.get(name, _MISSING) is not value and _beneath_shim(namespace, name) is not value


class NamespaceReads:
    """(namespace dict, name) -> the object a trace found there; `unchanged()` is the per-call check."""

    __slots__ = ("_reads", "_labels", "_whole", "_lookups", "sentinel")  # (sentinel: read by the generated guard code)

    def __init__(self) -> None:
        self._reads: dict[int, tuple[dict, dict[str, Any]]] = {}
        self._labels: dict[int, str] = {}
        self._whole: dict[int, tuple[dict, dict]] = {}  # namespaces guarded item by item (a class's methods)
        # names checked by a key lookup each per call, not by their namespace's version: where other writes to it do
        # not matter, or happen on every call (a module's globals, which a script's loop writes on every step;
        # nn.Module's class dict, whose `__call__` piecewise runs swap)
        self._lookups: dict[int, tuple[dict, dict[str, Any]]] = {}
        self.sentinel: Callable[[], bool] | None = None

    def __bool__(self) -> bool:
        return bool(self._reads or self._whole or self._lookups)

    def note_lookup(self, namespace: dict, label: str, name: str, value: Any) -> None:
        """`namespace[name]` must stay the object `value` (ABSENT_NAME: stay absent), checked by its key alone:
        `nn.Module.__call__` as a module call finds it, a global that would shadow the builtin the code loaded."""
        entry = self._lookups.get(id(namespace))
        if entry is None:
            entry = self._lookups[id(namespace)] = (namespace, {})
            self._labels.setdefault(id(namespace), label)
        if name not in entry[1]:
            entry[1][name] = value
            self.sentinel = None

    def note(self, namespace: dict, label: str, name: str, value: Any) -> None:
        entry = self._reads.get(id(namespace))
        if entry is None:
            entry = self._reads[id(namespace)] = (namespace, {})
            self._labels[id(namespace)] = label
        entry[1].setdefault(name, value)
        self.sentinel = None

    def note_whole(self, namespace: dict, label: str) -> None:
        """Every name of `namespace` as it is now (torch.Tensor's methods: a patched one changes the trace)."""
        if id(namespace) not in self._whole:
            self._whole[id(namespace)] = (namespace, dict(namespace))
            self._labels[id(namespace)] = label
            self.sentinel = None

    def unchanged(self) -> bool:
        sentinel = self.sentinel
        if sentinel is not None and sentinel():
            return True
        if self.first_change() is not None:
            return False
        self.sentinel = dict_sentinel([d for d, _ in (*self._reads.values(), *self._whole.values())],
                                      list(self._lookups.values()), _MISSING)
        return True

    def first_change(self) -> str | None:
        """`label.name` of the first name that no longer holds the object the trace found; None if all hold."""
        for key, (namespace, names) in self._reads.items():
            for name, value in names.items():
                if not same_constant(namespace.get(name, _MISSING), value):  # (a constant: by its value)
                    return f"{self._labels[key]}.{name}"
        for key, (namespace, names) in self._lookups.items():
            for name, value in names.items():
                if _moved(namespace, name, value):
                    return f"{self._labels[key]}.{name}"
        for key, (namespace, before) in self._whole.items():
            if len(namespace) != len(before) or any(namespace.get(k, _MISSING) is not v for k, v in before.items()):
                changed = next((k for k, v in before.items() if namespace.get(k, _MISSING) is not v),
                               next((k for k in namespace if k not in before), "?"))
                return f"{self._labels[key]}.{changed}"
        return None

    def put_back(self) -> None:
        """Every name noted as the trace found it (after a failed capture whose program stored into a namespace)."""
        for namespace, names in self._reads.values():
            written = False
            for name, value in names.items():
                if value is _MISSING:
                    written |= namespace.pop(name, _MISSING) is not _MISSING
                elif namespace.get(name, _MISSING) is not value:
                    namespace[name] = value
                    written = True
            if written:
                _modified(namespace)
        for namespace, names in self._lookups.values():
            written = False
            for name, value in names.items():
                if _moved(namespace, name, value):
                    written = True
                    if value is _MISSING:
                        del namespace[name]
                    else:
                        namespace[name] = value
            if written:
                _modified(namespace)
        for namespace, before in self._whole.values():
            gone = [k for k in namespace if k not in before]
            for name in gone:
                del namespace[name]
            changed = {k: v for k, v in before.items() if namespace.get(k, _MISSING) is not v}
            namespace.update(changed)
            if gone or changed:
                _modified(namespace)

    def describe(self) -> str:
        change = self.first_change()
        return "every name as read" if change is None else f"{change} rebound"


# The process environment is a namespace too: `os.getenv`, `os.environ.get`, `k in os.environ` all end in
# `os._Environ.__getitem__` (standard-library Python reading its dict of encoded names), iterating it in
# `__iter__`. The names read are guarded by identity like module attributes: `os.environ[k] = v` stores a new
# encoded value (and `putenv` alone, which os.environ does not see, is not seen by eager's reads either).
ENVIRON_READS: Mapping[types.CodeType, str] = types.MappingProxyType({
    type(os.environ).__getitem__.__code__: "item", type(os.environ).__iter__.__code__: "whole",
    type(os.environ).__len__.__code__: "whole"})


def note_environ_read(reads: NamespaceReads, frame: types.FrameType, how: str) -> None:
    """`frame` runs an `os._Environ` method of ENVIRON_READS: what it is about to read, noted in `reads`."""
    env = frame.f_locals.get("self")
    data = getattr(env, "_data", None)
    if type(data) is not dict:
        return
    if how == "whole":
        reads.note_whole(data, "os.environ")
        return
    try:
        key = env.encodekey(frame.f_locals.get("key"))
    except (TypeError, ValueError, AttributeError):  # (it raises the same for the program, reading nothing)
        return
    reads.note(data, "os.environ", key, data.get(key, _MISSING))
