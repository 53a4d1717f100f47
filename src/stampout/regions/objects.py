"""How a region frame sees the objects its trace reads: which are guarded by identity, which are containers
walked item by item, which are user classes (their attributes guarded) and which are stampout's own, and the
metadata a tensor attribute is compared by."""

from __future__ import annotations

import collections
import functools
import os
import re
import threading
import types
from typing import Any

import torch

from .. import caches
from ..guards.guard import const_key, is_auto_mark, is_constant
from ..sources import MISSING
from ..torch_internals import HigherOrderOperator, OpOverload, OpOverloadPacket
from ..trace.code import is_user_class as is_user_class_object
from ..trace.code import is_user_file
from ..trace.shapes import size_key, sizes_key
from ..watch.tracking import original_class, shim_class

CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict, torch.nn.ParameterList,
               torch.nn.ParameterDict)


# Immutable callables, namespaces and C descriptors (a namedtuple's field, a slot): guarded by identity.
BY_IDENTITY = (types.BuiltinFunctionType, types.BuiltinMethodType, types.ModuleType, type,
                types.MethodWrapperType, types.WrapperDescriptorType, types.MethodDescriptorType,
                types.ClassMethodDescriptorType, OpOverload, OpOverloadPacket,
                HigherOrderOperator, functools._lru_cache_wrapper, types.CodeType, re.Pattern,
                type(collections.namedtuple("_Pair", "a").a), types.MemberDescriptorType, types.GetSetDescriptorType,
                type(threading.Lock()), type(threading.RLock()),  # (a lock: taken and given back within a call)
                type(os.environ))  # (the process environment: what is read of it, by name: guards/namespaces.py)


_MEMBER = type(type.__dict__["__dict__"])  # slot and getset descriptors hold per-instance values


_SLOT = types.MemberDescriptorType


def class_set(value: Any) -> bool:
    """A set of classes (a registry of types): guarded by its members, each compared by identity (its metaclass
    neither compares nor hashes otherwise)."""
    return type(value) in (set, frozenset) and all(
        isinstance(v, type) and type(v).__eq__ is type.__eq__ and type(v).__hash__ is type.__hash__ for v in value)


def raw_meta(t: torch.Tensor) -> tuple:
    return (type(t), tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.requires_grad, t.layout)


def meta_key(meta: tuple) -> tuple:
    cls, shape, stride, offset, *rest = meta
    return (cls, sizes_key(shape), sizes_key(stride), size_key(offset), *rest)


def contents(value: Any) -> Any:
    if is_constant(value):
        return const_key(value)
    if isinstance(value, dict):
        return tuple((k, id(v)) for k, v in dict.items(value))  # (a subclass's own item reads: its Python)
    return tuple(id(v) for v in value)


def copy_value(value: Any) -> Any:
    return dict(dict.items(value)) if isinstance(value, dict) else list(value)


def accepted_types(obj: Any) -> tuple[type, ...]:
    """The object's class and the shim classes stampout may have swapped in (read and write watching)."""
    cls = original_class(obj)
    shim = shim_class(cls)
    return (cls,) if shim is None else (cls, shim)


def found_on_class(obj: Any, name: str) -> tuple[bool, Any]:
    """(True, raw class attribute) when `obj.name` came from its class, not from the instance."""
    d = instance_fields(obj)
    if d is not None and name in d and not is_auto_mark(d[name]):
        return False, None
    for klass in original_class(obj).__mro__:
        raw = klass.__dict__.get(name, MISSING)
        if raw is not MISSING:
            return not isinstance(raw, (_SLOT, _MEMBER)), raw
    return False, None


def hidden_state(cls: type) -> bool:
    """Whether instances keep state in C fields that attribute watching cannot see (`random.Random`)."""
    declared = [k.__dict__.get("__slots__") for k in cls.__mro__]
    slots = sum(len(d) for d in declared if isinstance(d, (tuple, list)))
    return cls.__basicsize__ > object.__basicsize__ + 8 * slots + 16


@caches.memo
def fake_fields() -> frozenset[str]:
    """The attributes every FakeTensor keeps in its `__dict__` (its mode, memos): not the program's."""
    from ..torch_internals import FakeTensorMode

    with FakeTensorMode() as mode:
        return frozenset(mode.from_tensor(torch.empty(0)).__dict__)


def program_fields(fields: Any) -> list[str]:
    """The names in a tensor's `__dict__` (or several merged) that the program set (`x.scale = s`): not a
    FakeTensor's own fields, nor private ones."""
    internal = fake_fields()
    return [k for k in fields or () if k not in internal and not k.startswith("_")]


_STAMPOUT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def ours(value: Any) -> bool:
    code = getattr(value, "__code__", None)
    return isinstance(code, types.CodeType) and code.co_filename.startswith(_STAMPOUT_DIR)


def by_name(value: Any) -> bool:
    """A module attribute guarded by identity alone: a namespace, class, builtin or library function (not one
    of stampout's own, which replace torch's only while a capture runs: `torch.compiler.is_compiling`)."""
    if isinstance(value, types.FunctionType):
        filename = value.__code__.co_filename
        return not is_user_file(filename) and not filename.startswith(_STAMPOUT_DIR)
    return isinstance(value, BY_IDENTITY) or isinstance(value, (torch.dtype, torch.device))


def served_by_getattr(obj: Any, name: str) -> bool:
    """Whether `obj.name` comes from (or is refused by) a user class's `__getattr__`: neither the instance nor its
    class has it. Its Python ran in the trace, which guarded what it read; a guard reading `obj.name` would run it
    again on every check (a counter it keeps, a log it appends to: side effects eager makes once per read)."""
    if isinstance(obj, torch.nn.Module):
        return False  # (its attributes are guarded through its registries: no __getattr__ runs)
    mro = original_class(obj).__mro__
    if not any("__getattr__" in k.__dict__ and is_user_class_object(k) for k in mro):
        return False
    fields = instance_fields(obj)
    return not (fields is not None and name in fields) and all(name not in k.__dict__ for k in mro)


def instance_fields(obj: Any) -> dict | None:
    """The instance's `__dict__` without running its class's `__getattr__` (a slotted object has none)."""
    try:
        fields = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None
    return fields if type(fields) is dict else None


def is_user_class(obj: Any, name: str) -> bool:
    """Whether the class that defines `name` for `obj` is user code (not torch's or stampout's)."""
    for klass in original_class(obj).__mro__:
        if name in klass.__dict__:  # (object's own: guarded as a user class's, so an instance override is seen)
            return klass is object or is_user_class_object(klass)
    return False
