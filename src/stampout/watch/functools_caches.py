"""What a capture does with the `functools.cache` / `lru_cache` results the program stored while it ran."""

from __future__ import annotations

import gc
from typing import Any

from ..torch_internals import DisableTorchFunction
from ..trace.op_facts import drawn_at_random
from ..trace.structure import fakes_within, holds_fake


# Note: functools caches
# A cache the program fills during a capture is state eager keeps: a real result stays (the next call is a hit, as
# in eager, whatever the state it was computed from holds by then). A traced result (a tensor the graph computes)
# cannot stay: it is taken out, and each call's graph computes it again, which gives eager's values unless it drew
# random numbers (`torch.randn` memoized: eager draws once, then hits). Then the capture is refused, and `compile`
# runs that call eagerly, which fills the cache with the real result its later captures hit. An unbounded cache
# (`functools.cache`) loses only its traced entries; a bounded one cannot give up one entry, and is cleared.
def _results(wrapper: Any) -> list[Any]:
    """What a functools cache holds (its dict of results, or its links' keys and results; gc sees them)."""
    own = (getattr(wrapper, "__dict__", None), getattr(wrapper, "__wrapped__", None))
    return [r for r in gc.get_referents(wrapper) if not any(r is o for o in own) and not isinstance(r, type)]


def remove_traced_results(wrapper: Any, nodes: dict[int, Any] | None) -> bool | None:
    """Take the results holding a fake out of a functools cache; None when there was none, else whether one of
    them was drawn at random in the graph of `nodes` (a fake not found there counts as drawn)."""
    with DisableTorchFunction():
        held = _results(wrapper)
        fakes = [t for r in held for t in fakes_within(r)]
        if not fakes:
            return None
        table = next((r for r in held if type(r) is dict), None)
        if wrapper.cache_parameters().get("maxsize", 0) is None and table is not None:
            for key in [k for k, v in list(table.items()) if holds_fake(v, whole=True) or holds_fake(k, whole=True)]:
                del table[key]
        else:
            wrapper.cache_clear()
    return nodes is not None and any(id(t) not in nodes or drawn_at_random(nodes[id(t)][1]) for t in fakes)


class CacheReads:
    """The functools caches a compiled program got values from, as the capture left them: a hit's result is baked
    into the graph, so `cache_clear()` (or any other change of what a cache holds: a miss, an eviction) between
    calls captures again. Checked like a NamespaceReads (Kind.NAMESPACE): `unchanged()` per call."""

    __slots__ = ("_caches", "sentinel")

    def __init__(self, caches: list[Any]) -> None:
        self._caches = [(w, _state(w), held_results(w)) for w in caches]  # (the contents kept alive: compared by `is`)
        self.sentinel = None

    def unchanged(self) -> bool:
        return self._first_change() is None

    def _first_change(self) -> Any:
        for wrapper, state, contents in self._caches:
            if _state(wrapper) != state:
                return wrapper
            now = held_results(wrapper)
            if len(now) != len(contents) or any(a is not b for a, b in zip(now, contents)):
                return wrapper
        return None

    def describe(self) -> str:
        changed = self._first_change()
        return "every cache as read" if changed is None else f"the cache of {_name(changed)} changed"


def _state(wrapper: Any) -> tuple[int, int]:
    info = wrapper.cache_info()
    return info.misses, info.currsize


def held_results(wrapper: Any) -> list[Any]:
    """The results a cache holds (a cleared and refilled cache has as many misses, not the same objects); a large
    cache by its counts alone."""
    if wrapper.cache_info().currsize > _COMPARED_RESULTS:
        return []
    held = _results(wrapper)
    table = next((r for r in held if type(r) is dict), None)
    return list(table.values()) if table is not None else held


_COMPARED_RESULTS = 64


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)
