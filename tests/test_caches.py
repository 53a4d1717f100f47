"""stampout.caches: every module-level memo cache is registered, and `stampout.reset()` empties each one."""

from __future__ import annotations

import functools
import math
import sys
import weakref

import pytest
import torch
from torch import nn

import stampout
from stampout import caches

# Module-level containers that grow while stampout runs but are not caches (clearing them would break what
# holds them), with why.
NOT_CACHES = {
    "stampout.compile.function._LIVE": "the live compiled functions (a WeakSet reset() walks to reset each)",
    "stampout.watch.tracking._WRITE_WATCHERS": "objects whose class live compiled functions swapped, to watch writes",
    "stampout.watch.tracking._SHIMS": "shim classes; objects still swapped to one compare by it",
    "stampout.watch.tracking._REGISTRATION_HOOKS": "torch's global registration hooks, installed once",
    "stampout.torch_internals.parameter_writes._PATCHED_PARAMETER": "the permanent patch of Parameter methods, "
                                                                    "installed once",
    "stampout.backends.timing.RECORDS": "the compile-time log benches read",
    "stampout.watch.classpatch._PATCHES": "classes patched in place while a capture or compiled function watches them",
    "stampout.watch.classpatch.WRITE_IDS": "instances whose writes live compiled functions watch",
    "stampout.watch.tracking.WRITE_IDS": "(classpatch.WRITE_IDS)",
    "stampout.torch_internals.registry.PERMANENT_PATCHES": "the permanent patches this process installed, each once",
    "stampout.torch_internals.PERMANENT_PATCHES": "(registry.PERMANENT_PATCHES)",
    "stampout.torch_internals.native_tensors._LOADED": "the native extension, loaded (or found missing) once",
    "stampout.guards.namespaces._OWNERS": "each live class whose dict a guard read, to refresh CPython's type "
                                          "attribute cache when a capture puts that dict back (entries leave with "
                                          "their class)",
}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @stampout.region
    def forward(self, x):
        return torch.relu(self.lin(x)) * math.sqrt(2.0)


class Marked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @torch.compiler.nested_compile_region
    def forward(self, x):
        return torch.nn.functional.relu(self.lin(x)) + 1


def _workload():
    model = nn.Sequential(Block(), Block(), Marked(), Marked())
    x = torch.randn(2, 4)
    stampout.capture(model, x)
    fn = stampout.compile(model, backend="eager")
    fn(x)
    fn(x)
    return fn


_CONTAINERS = (dict, list, set, weakref.WeakKeyDictionary, weakref.WeakValueDictionary, weakref.WeakSet,
               functools._lru_cache_wrapper)


def _containers():
    out = {}
    for name, module in list(sys.modules.items()):
        if name != "stampout" and not name.startswith("stampout."):
            continue
        for attr, value in list(vars(module).items()):
            if not attr.startswith("__") and isinstance(value, _CONTAINERS):
                out[f"{name}.{attr}"] = value
    return out


def _size(value):
    return caches.size(value) if isinstance(value, functools._lru_cache_wrapper) else len(value)


def test_every_growing_module_container_is_a_registered_cache_or_says_why_not():
    registered = {id(c) for c in caches.registered().values()}
    before = {name: _size(v) for name, v in _containers().items()}
    keep = _workload()
    grown = sorted(name for name, v in _containers().items() if _size(v) > before.get(name, 0)
                   and id(v) not in registered and name not in NOT_CACHES)
    assert not grown, f"register these with stampout.caches, or list them in NOT_CACHES with why: {grown}"
    del keep


def test_reset_empties_every_registered_cache():
    keep = _workload()
    filled = {name for name, cache in caches.registered().items() if caches.size(cache)}
    # (the split backend's compiled regions fill with Inductor only)
    assert {"trace.code facts", "builder node targets",
            "regions.purity function verdicts", "frames own files"} <= filled
    stampout.reset()
    assert {name: caches.size(c) for name, c in caches.registered().items() if caches.size(c)} == {}
    del keep


def test_reset_then_capture_again_gives_the_same_counts():
    model = nn.Sequential(Block(), Block(), Marked(), Marked())
    x = torch.randn(2, 4)
    first = stampout.capture(model, x).stats
    stampout.reset()
    again = stampout.capture(model, x)
    assert (again.stats.traces, again.stats.reuses) == (first.traces, first.reuses) == (2, 2)
    torch.testing.assert_close(again(x), model(x))


def test_memo_registers_a_cleared_function_cache():
    calls = []

    @caches.memo
    def square(n):
        calls.append(n)
        return n * n

    try:
        assert square(3) == 9 and square(3) == 9 and calls == [3]
        assert caches.size(caches.registered()[f"{__name__}.{square.__qualname__}"]) == 1
        caches.clear_all()
        assert square(3) == 9 and calls == [3, 3]
    finally:
        caches._REGISTRY.pop(f"{__name__}.{square.__qualname__}")


def test_register_refuses_what_cannot_be_cleared():
    with pytest.raises(TypeError, match=r"caches.register\('t'\): a tuple has neither clear\(\) nor cache_clear\(\)"):
        caches.register((), "t")


def test_a_class_dict_owner_leaves_with_its_class():
    import gc

    from stampout.guards import namespaces

    cls = type("Passing", (), {})
    key = id(namespaces.class_dict(cls))
    assert namespaces._OWNERS[key]() is cls
    del cls
    gc.collect()
    assert key not in namespaces._OWNERS
