"""Every memo cache stampout keeps in a module, in one registry that `stampout.reset()` walks (as JAX's
`register_cache` / `clear_caches`). A cache registers where it is defined:

    _FACTS: dict[types.CodeType, CodeFacts] = caches.register({}, "trace.code facts")

    @caches.memo
    def _fake_fields() -> frozenset[str]: ...

Only caches register: what they hold is found again on a miss, so clearing one costs time, never meaning.
State that is not a cache does not (classes patched in place, the write watchers of live compiled functions,
the shim classes of objects swapped to them: clearing those would break their holders). Imports nothing of
stampout or torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

C = TypeVar("C")
F = TypeVar("F", bound=Callable[..., Any])

_REGISTRY: dict[str, Any] = {}


def register(cache: C, name: str) -> C:
    """Add `cache` (a dict, a weak dictionary, a set or an `lru_cache` wrapper) under `name`; returns it."""
    if not (hasattr(cache, "cache_clear") or hasattr(cache, "clear")):
        raise TypeError(f"caches.register({name!r}): a {type(cache).__name__} has neither clear() nor cache_clear()")
    _REGISTRY[name] = cache  # (a module reloaded registers its new cache under the same name)
    return cache


def memo(fn: F) -> F:
    """`functools.cache(fn)`, registered under the function's module and name."""
    cached = functools.cache(fn)
    register(cached, f"{fn.__module__}.{fn.__qualname__}")
    return cached  # type: ignore[return-value]


def registered() -> dict[str, Any]:
    """The registered caches by name."""
    return dict(_REGISTRY)


def size(cache: Any) -> int:
    """How many entries `cache` holds."""
    return cache.cache_info().currsize if hasattr(cache, "cache_info") else len(cache)


def clear_all() -> None:
    """Empty every registered cache."""
    for cache in _REGISTRY.values():
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
        else:
            cache.clear()
