"""Real values for tensors computed only from constants, so Python may look at them during capture.

`mask = torch.triu(torch.full((n, n), float("-inf")), 1)` depends on nothing but `n`; code such as
`bool((mask == causal).all())` (nn.Transformer does this) is fine to evaluate while tracing, because the
answer can never differ at run time. stampout computes such tensors for real beside their fakes (small
ones, deterministic ops only) and answers `bool`, `item`, `tolist` and friends from the real value. Any
in-place change that mixes in a non-constant value forgets every known value.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from typing import Any

import torch

from .. import config
from ..torch_internals import unset_fake_temporarily
from .op_facts import deterministic, writes_in_place
from .structure import map_leaves, tensors_of

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
        return (t, repr(value) if value == value else _nan(value))  # exact, and NaN equals NaN of its sign
    if isinstance(value, float):  # (a float subclass, NumPy's float64: its own == takes 0.0 for -0.0)
        return (t, float.__repr__(value) if float.__eq__(value, value) else _nan(value))
    if isinstance(value, complex):
        return (t, complex.__repr__(value))
    if t in (tuple, list, torch.Size):
        return (t, tuple(const_key(v) for v in value))
    if t in (set, frozenset):  # (in its iteration order: equal sets may iterate apart, `frozenset([8, 0])`'s
        return (t, tuple(const_key(v) for v in value))  # and `frozenset([0, 8])`, and a loop over one is traced)
    if t is dict:
        return (t, tuple((const_key(k), const_key(v)) for k, v in value.items()))
    if t in (slice, range):
        return (t, repr(value))
    return (t, value)


IMMUTABLE_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def immutable_constant(value: Any) -> bool:
    """A constant no one can change in place (a scalar, or a tuple or frozenset of them): its identity says its
    value, and an equal one (same type, same const_key) behaves the same."""
    if type(value) in IMMUTABLE_TYPES:
        return True
    return type(value) in (tuple, frozenset) and all(immutable_constant(v) for v in value)


def same_constant(now: Any, then: Any) -> bool:
    """`now` is `then`, or both are equal immutable constants of one type (`Cls.flag = float(0)` stores a new
    0.0 each time: no program behaves differently)."""
    return now is then or (type(now) is type(then) and immutable_constant(then) and immutable_constant(now)
                           and const_key(now) == const_key(then))


def _nan(value: float) -> str:
    """A NaN's text with its sign and payload (repr prints `nan` for all: `math.copysign(1.0, x)` tells them
    apart)."""
    return f"nan({struct.pack('>d', value).hex()})"


class ConstantValues:
    """id(fake) -> (fake, real value, scope) for tensors that depend on constants only.

    The scope is the set of region frames (by id, from `scope_fn`) that were open wherever the value's
    inputs were made: a frame outside it did not compute the value from its own guarded reads."""

    def __init__(self, scope_fn: Callable[[], frozenset[int]] = frozenset) -> None:
        self._known: dict[int, tuple[torch.Tensor, torch.Tensor, frozenset[int]]] = {}
        self._scope_fn = scope_fn

    def scope_of(self, args: tuple, kwargs: dict) -> frozenset[int]:
        """The frames that made every (known) tensor among the arguments."""
        scopes = [self._known[id(t)][2] for t in tensors_of((args, kwargs)) if id(t) in self._known]
        return frozenset.intersection(*scopes) if scopes else self._scope_fn()

    def real(self, t: torch.Tensor) -> torch.Tensor | None:
        hit = self._known.get(id(t))
        return None if hit is None else hit[1]

    def _to_real(self, value: Any) -> Any:
        return map_leaves(value, lambda v: self._known[id(v)][1] if isinstance(v, torch.Tensor) else v)

    def evaluate(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """`func` run on the real values of its (all known) tensor arguments."""
        with unset_fake_temporarily():
            return func(*self._to_real(args), **self._to_real(kwargs))

    def remember(self, fakes: Any, reals: Any, scope: frozenset[int]) -> None:
        for fake, value in zip(tensors_of(fakes), tensors_of(reals)):
            self._known[id(fake)] = (fake, value, scope)

    def knows_all(self, args: tuple, kwargs: dict) -> bool:
        return all(id(t) in self._known for t in tensors_of((args, kwargs)))

    def forget_if_mutated(self, func: Callable, args: tuple, kwargs: dict) -> None:
        """An op whose result is not constant: if it writes into a known tensor, forget every known value."""
        if not self._known or not writes_in_place(func, args, kwargs):
            return
        if any(id(t) in self._known for t in tensors_of((args, kwargs))):
            self._known.clear()

    def after(self, func: Callable, args: tuple, kwargs: dict, out: Any, tensors_in: bool) -> None:
        """Track the real value of `out` when every input is constant; forget all on a mixed mutation."""
        if tensors_in and not self._known:
            return
        inputs_known = self.knows_all(args, kwargs)
        if not inputs_known:
            if writes_in_place(func, args, kwargs) and any(id(t) in self._known for t in tensors_of((args, kwargs))):
                self._known.clear()
            return
        outs = tensors_of(out)
        if not outs or not deterministic(func) or any(t.numel() > config.constant_max_numel for t in outs):
            return
        try:
            real = self.evaluate(func, args, kwargs)
        except Exception:  # a device we do not have, an op without a real kernel: just not constant
            return
        self.remember(outs, real, self.scope_of(args, kwargs))
