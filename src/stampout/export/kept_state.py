"""`kept_state`: the Python state a capture may change, put back as it was (export leaves the model as it found
it, as torch.export does: a step counter, an EMA buffer, an attribute the forward writes, RNG states).

A capture runs the program's Python on fake tensors: real tensors are only written when the graph is run to
make stores real (`capture_program(real=False)` skips that), so what can move is Python state: attributes and
registries of the modules, the objects and containers the inputs hold, and the random generators.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ..capture.effects import put_back
from ..trace.names import root_module
from ..watch.world import RandomStates

_REGISTRIES = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def _contents(obj: Any) -> Any:
    return dict(obj) if isinstance(obj, dict) else list(obj) if isinstance(obj, list) else set(obj)


@contextlib.contextmanager
def kept_state(fn: Callable, held: list[Any]) -> Iterator[None]:
    """Put back, on exit, every module of `fn` (its `__dict__`, registries and the lists, dicts and sets it
    holds), the objects in `held` (what the call's inputs reach: their fields or items) and the RNG states."""
    saved: list[tuple[Any, Any]] = []
    seen: set[int] = set()

    def keep(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if type(obj) in (dict, list, set):
            saved.append((obj, _contents(obj)))
            return
        fields = getattr(obj, "__dict__", None)
        if type(fields) is not dict:
            return
        saved.append((fields, dict(fields)))
        for value in list(fields.values()):
            if type(value) in (dict, list, set):
                keep(value)

    root = root_module(fn)
    for module in root.modules() if root is not None else ():
        keep(module)
        for name in _REGISTRIES:
            registry = module.__dict__.get(name)
            if registry is not None:
                keep(registry)
    for obj in held:
        keep(obj)
    rng = RandomStates.save()
    try:
        yield
    finally:
        for obj, before in reversed(saved):
            put_back(obj, before)
        rng.restore()
