"""The values guards compare: how a constant's key prints (which values a trace may bake in as constants, and the
keys they are compared by, are trace/constants.py's); the small readers the generated predicate calls (an object's
own `__dict__`, a module attribute as nn.Module resolves it, a length).
No guards here: guards/rules.py holds the rule of each kind.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch

from ..sources import MISSING
from ..trace.constants import IMMUTABLE_TYPES as IMMUTABLE_TYPES
from ..trace.constants import const_key as const_key  # (the guards import these from here)
from ..trace.constants import immutable_constant as immutable_constant
from ..trace.constants import is_constant as is_constant
from ..trace.constants import same_constant as same_constant


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


def module_attr(v: Any, name: str) -> Any:
    """`getattr(module, name)` for a name its class does not define, as nn.Module resolves it (`_module_attr` in
    the generated guards; capture/world.ModulePaths reads parameter paths with it)."""
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
    return type(value) is MethodType and getattr(value.__func__, "__stampout_auto__", False) is True  # (no getattr
    # on a user's object: its __getattr__ would run, a side effect of the program's)


def _length(value: Any) -> Any:
    try:
        return len(value)
    except TypeError:
        return MISSING
