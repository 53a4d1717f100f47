"""The world outside the watched objects, as a capture leaves it.

A capture runs the program's Python once, on fake tensors. Two things outside the objects stampout watches
are put right afterwards, whether the capture succeeded or failed:

- the random number generators the Python may have drawn from (Python's `random`, NumPy's global state,
  torch's CPU generator) are put back as they were before the capture (`RandomStates`): the capture is not a
  call, and a seeded program gives eager's numbers afterwards (the draws themselves make a trace ineligible,
  see regions/purity.py);
- no fake tensor or symbolic size stays reachable from the state the program's code could reach: here, how a
  fake is found in a value (`holds_fake`) and taken out of objects' attributes (`clear_fakes`); the memo caches,
  module globals and class dicts its code may reach are remembered and repaired by world_snapshot.py.
"""

from __future__ import annotations

import functools
import random
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch

from .. import config
from ..torch_internals import FakeTensor
from ..trace.shapes import concrete


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


_ATOMIC = frozenset((type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device))


def holds_fake(value: Any, depth: int = 0, tensors_only: bool = False) -> bool:
    """Whether a FakeTensor (or, unless `tensors_only`, a symbolic size) is inside `value` (containers and
    plain objects, a few levels deep)."""
    t = type(value)
    if t in _ATOMIC:  # (most values a module or config holds: no isinstance walk for them)
        return False
    if t is FakeTensor or isinstance(value, FakeTensor):
        return True
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return not tensors_only
    if depth >= config.scan_depth or isinstance(value, (torch.Tensor, torch.nn.Module, type, types.ModuleType)):
        return False
    if t in (list, tuple, set, frozenset) or isinstance(value, (list, tuple)):
        return len(value) <= config.scan_items and any(holds_fake(v, depth + 1, tensors_only) for v in value)
    if isinstance(value, dict):
        return len(value) <= config.scan_items and any(holds_fake(v, depth + 1, tensors_only) for v in value.values())
    fields = getattr(value, "__dict__", None)
    if type(fields) is dict and not callable(value):
        return len(fields) <= config.scan_items and any(holds_fake(v, depth + 1, tensors_only) for v in fields.values())
    return False


def clear_fakes(objects: list[Any], cleared: dict[int, Any] | None = None) -> list[str]:
    """Attributes of `objects` (modules, the call's input objects) that hold a fake tensor or a symbolic size
    written behind their `__setattr__` (`functools.cached_property`, `obj.__dict__[k] = v`): removed.
    Returns their names. `cleared`: the objects already made clean, by id (each object is walked once, so a
    config object that every layer holds costs one walk; kept alive here, so no id is reused meanwhile)."""
    removed = []
    cleared = {} if cleared is None else cleared
    for obj in objects:
        fields = getattr(obj, "__dict__", None)
        if type(fields) is not dict or id(obj) in cleared:
            continue
        cleared[id(obj)] = obj
        dirty = []
        for k, v in list(fields.items()):
            if k.startswith("_") or type(v) in _ATOMIC or id(v) in cleared:
                continue
            if holds_fake(v):
                dirty.append(k)
            elif plain_object(v):
                cleared[id(v)] = v  # (clean as found: a later holder of it need not look again)
        for key in dirty:
            value = fields[key]
            if type(value) in (list, dict) and not holds_fake(value, tensors_only=True):  # sizes stored in it
                _concrete_items(value)
                removed.append(f"{type(obj).__name__}.{key}")
                continue
            inner = getattr(value, "__dict__", None)
            if type(inner) is dict and not callable(value) and not isinstance(value, (torch.Tensor, torch.nn.Module)):
                # (its fields only; clean afterwards)
                removed.extend(f"{type(obj).__name__}.{name}" for name in clear_fakes([value], cleared))
                continue
            del fields[key]
            removed.append(f"{type(obj).__name__}.{key}")
    return removed


def _concrete_items(container: list | dict, depth: int = 0) -> None:
    """Each symbolic size in `container` (and the lists and dicts it holds) replaced by its value."""
    for key, item in list(container.items() if type(container) is dict else enumerate(container)):
        if type(item) in (list, dict) and depth < config.scan_depth:
            _concrete_items(item, depth + 1)
        elif holds_fake(item):
            container[key] = concrete(item)


def holds_traced_tensor(fn: Any) -> bool:
    """Whether a callable closes over (or defaults to, or is bound to) a fake tensor of the capture."""
    parts = [getattr(fn, "__self__", None), getattr(fn, "__defaults__", None), getattr(fn, "__kwdefaults__", None)]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            parts.append(cell.cell_contents)
        except ValueError:
            continue
    if isinstance(fn, functools.partial):
        parts.extend([fn.func, fn.args, fn.keywords])
    return any(holds_fake(p, tensors_only=True) for p in parts if p is not None)


def plain_object(value: Any) -> bool:
    """A user object with attributes of its own (not a module, tensor, class, function or namespace)."""
    return (type(getattr(value, "__dict__", None)) is dict and not callable(value)
            and not isinstance(value, (torch.nn.Module, torch.Tensor, type, types.ModuleType)))
