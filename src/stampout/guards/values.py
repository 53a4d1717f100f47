"""The values guards compare: which values a trace may bake in as constants, the keys constants are compared by
and how a key prints; the small readers the generated predicate calls (an object's own `__dict__`, a module
attribute as nn.Module resolves it, a length). No guards here: guards/rules.py holds the rule of each kind.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from .sources import MISSING

_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_ATOMS = (torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum, type(Ellipsis))


def is_constant(value: Any) -> bool:
    """Values a trace may bake in as constants: scalars, dtypes, devices, enums and containers of them."""
    if isinstance(value, _SCALARS) or isinstance(value, _ATOMS):
        return True
    if type(value) in (tuple, list, torch.Size, frozenset, set):
        return all(is_constant(v) for v in value)
    if type(value) is dict:
        return all(is_constant(k) and is_constant(v) for k, v in value.items())
    if type(value) in (slice, range):
        return True
    return False


def const_key(value: Any) -> Any:
    """A hashable key equal only for equal constants of the same type (`1`, `1.0`, `True` differ)."""
    t = type(value)
    if t is float:
        return (t, repr(value))  # exact, and NaN equals NaN
    if isinstance(value, float):  # (a float subclass, NumPy's float64: its own == takes 0.0 for -0.0)
        return (t, float.__repr__(value))
    if isinstance(value, complex):
        return (t, complex.__repr__(value))
    if t in (tuple, list, torch.Size):
        return (t, tuple(const_key(v) for v in value))
    if t in (set, frozenset):
        return (t, frozenset(const_key(v) for v in value))
    if t is dict:
        return (t, tuple((const_key(k), const_key(v)) for k, v in value.items()))
    if t in (slice, range):
        return (t, repr(value))
    return (t, value)


def show_const(key: Any) -> str:
    """A const_key as the value it stands for (`1e-06`, `'silu'`, `(1, 2)`), with its type when it matters."""
    t, value = key
    if t is float:
        return value
    if issubclass(t, (float, complex)):
        return f"{t.__name__}({value})"
    if t in (tuple, list, torch.Size):
        inner = ", ".join(show_const(k) for k in value)
        return f"({inner}{',' if len(value) == 1 else ''})" if t is tuple else f"[{inner}]" if t is list else \
            f"torch.Size([{inner}])"
    if t is dict:
        return "{" + ", ".join(f"{show_const(k)}: {show_const(v)}" for k, v in value) + "}"
    if t in (set, frozenset):
        return "{" + ", ".join(sorted(show_const(k) for k in value)) + "}"
    return repr(value)


OBJECT_GETATTRIBUTE = object.__getattribute__


def _object_dict(v: Any) -> Any:
    try:
        return OBJECT_GETATTRIBUTE(v, "__dict__")
    except AttributeError:
        return MISSING


def _module_attr(v: Any, name: str) -> Any:
    """`getattr(module, name)` for a name its class does not define, as nn.Module resolves it."""
    try:
        d = OBJECT_GETATTRIBUTE(v, "__dict__")
    except AttributeError:
        return MISSING
    if name in d:
        return d[name]
    for registry in ("_parameters", "_buffers", "_modules"):
        r = d.get(registry)
        if r is not None and name in r:
            return r[name]
    return MISSING


def is_auto_mark(value: Any) -> bool:
    """Whether `value` is the bound region wrapper `stampout.auto_regions` puts on a module for a capture."""
    return getattr(getattr(value, "__func__", None), "__stampout_auto__", False) is True


def _length(value: Any) -> Any:
    try:
        return len(value)
    except TypeError:
        return MISSING
