"""Real values for tensors computed only from constants, so Python may look at them during capture.

`mask = torch.triu(torch.full((n, n), float("-inf")), 1)` depends on nothing but `n`; code such as
`bool((mask == causal).all())` (nn.Transformer does this) is fine to evaluate while tracing, because the
answer can never differ at run time. stampout computes such tensors for real beside their fakes (small
ones, deterministic ops only) and answers `bool`, `item`, `tolist` and friends from the real value. Any
in-place change that mixes in a non-constant value forgets every known value.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from . import caches, config
from .structure import tensors_of

_RANDOM = ("rand", "normal", "bernoulli", "dropout", "multinomial", "poisson", "uniform", "exponential",
           "geometric", "cauchy", "log_normal", "random", "empty", "seed")


def _name(func: Callable) -> str:
    return getattr(func, "__name__", "") or ""


def deterministic(func: Callable) -> bool:
    name = _name(func).lower()
    return not any(word in name for word in _RANDOM)


_DRAWS: dict[Any, bool] = caches.register({}, "constants functions that draw random numbers")


def draws_random(func: Callable) -> bool:
    """Whether a torch function draws from a generator (`randn`, `dropout`, `normal_`; `empty` does not)."""
    try:
        return _DRAWS[func]
    except (KeyError, TypeError):
        name = _name(func).lower()
        draws = any(word in name for word in _RANDOM if word != "empty")
        try:
            _DRAWS[func] = draws
        except TypeError:
            pass
        return draws


def mutating(func: Callable, kwargs: dict, args: tuple = ()) -> bool:
    name = _name(func)
    return name.endswith("_") and not name.endswith("__") or name in ("__setitem__", "setitem") or (
        name.startswith("__i") and name.endswith("__")) or "out" in kwargs or _inplace(func, args, kwargs)


_INPLACE_AT: dict[Any, int | None] = caches.register({}, "constants inplace positions")


def inplace_position(func: Callable) -> int | None:
    """The position of a function's `inplace` parameter (`F.relu(x, inplace=True)`), if it has one."""
    try:
        return _INPLACE_AT[func]
    except (KeyError, TypeError):
        pass
    position = None
    try:
        names = list(inspect.signature(func).parameters)
        position = names.index("inplace") if "inplace" in names else None
    except (TypeError, ValueError):
        pass
    try:
        _INPLACE_AT[func] = position
    except TypeError:
        pass
    return position


def _inplace(func: Callable, args: tuple, kwargs: dict) -> bool:
    """`F.relu(x, inplace=True)` and friends: a function with an `inplace` parameter, asked to use it."""
    if "inplace" in kwargs:
        return kwargs["inplace"] is True
    position = inplace_position(func)
    return position is not None and position < len(args) and args[position] is True


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
        if isinstance(value, torch.Tensor):
            return self._known[id(value)][1]
        if isinstance(value, (tuple, list)):
            return type(value)(self._to_real(v) for v in value)
        if isinstance(value, dict):
            return {k: self._to_real(v) for k, v in value.items()}
        return value

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
        if not self._known or not mutating(func, kwargs, args):
            return
        if any(id(t) in self._known for t in tensors_of((args, kwargs))):
            self._known.clear()

    def after(self, func: Callable, args: tuple, kwargs: dict, out: Any, tensors_in: bool) -> None:
        """Track the real value of `out` when every input is constant; forget all on a mixed mutation."""
        if tensors_in and not self._known:
            return
        inputs_known = self.knows_all(args, kwargs)
        if not inputs_known:
            if mutating(func, kwargs, args) and any(id(t) in self._known for t in tensors_of((args, kwargs))):
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
