"""Lookups a program keeps outside its tensors: a decision on `id()`, a class memo keyed by dtype, a weak-key memo
global keyed by module, a module with its own `__getattr__`. Each is read for real and guarded, never baked."""

from __future__ import annotations

import copy
import functools
import logging
import types
import weakref

import pytest
import torch
from torch import nn

import stampout


class IdBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if (id(x) >> 4) % 2 else self.b(x)


def test_a_decision_on_id_is_not_baked(caplog):
    torch.manual_seed(0)
    model = IdBranch()
    fn = stampout.compile(model, backend="eager")
    with caplog.at_level(logging.WARNING, logger="stampout"):
        for _ in range(12):
            x = torch.randn(2, 4)
            torch.testing.assert_close(fn(x), model(x))
    assert any("builtins.id" in r.getMessage() for r in caplog.records)


class ShapeDtypeMasks(nn.Module):
    masks: dict = {}

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = (x.shape[-2], x.dtype)  # (a dtype in a key: the guard on the item cannot be written as a literal)
        if key not in type(self).masks:
            type(self).masks[key] = torch.tril(torch.ones(x.shape[-2], x.shape[-2]))
        return (self.lin(x).transpose(-1, -2) @ type(self).masks[key]).transpose(-1, -2)


def test_a_class_memo_keyed_by_dtype_is_guarded():
    ShapeDtypeMasks.masks.clear()
    torch.manual_seed(0)
    model = nn.Sequential(ShapeDtypeMasks(), ShapeDtypeMasks())
    fn = stampout.compile(copy.deepcopy(model), backend="eager", regions="auto")
    for n in (3, 4, 3):
        x = torch.randn(2, n, 5)
        torch.testing.assert_close(fn(x), model(x))
    assert all(type(v) is torch.Tensor for v in ShapeDtypeMasks.masks.values())


MEMO_BY_MODULE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class WeakMemo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = MEMO_BY_MODULE.get(self)
        if m is None:
            m = MEMO_BY_MODULE[self] = torch.ones(4) * 0.5
        return self.lin(x) * m


@pytest.mark.parametrize("how", ["capture", "compile"])
def test_a_weak_key_memo_global_is_kept_and_real(how):
    MEMO_BY_MODULE.clear()
    torch.manual_seed(0)
    model = WeakMemo()
    x = torch.randn(2, 4)
    expected = model(x)
    MEMO_BY_MODULE.clear()
    if how == "capture":
        stampout.capture(model, x)
    else:
        torch.testing.assert_close(stampout.compile(model, backend="eager")(x), expected)
    assert globals().get("MEMO_BY_MODULE") is not None  # (the repair once deleted the global itself)
    assert all(type(v) is torch.Tensor for v in MEMO_BY_MODULE.values())
    torch.testing.assert_close(model(x), expected)


class _Settings(types.ModuleType):
    def __getattr__(self, name: str):
        return SETTINGS_VALUES[name]  # (raises KeyError, not AttributeError, for `__file__`)


SETTINGS_VALUES = {"gain": 2.0}
SETTINGS = _Settings("settings")


class SettingsReader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * SETTINGS.gain


def test_a_module_with_its_own_getattr_is_read_and_guarded():
    torch.manual_seed(0)
    model = SettingsReader()
    fn = stampout.compile(model, backend="eager")
    x = torch.randn(2, 4)
    torch.testing.assert_close(fn(x), model(x))
    SETTINGS_VALUES["gain"] = -1.0
    try:
        torch.testing.assert_close(fn(x), model(x))
    finally:
        SETTINGS_VALUES["gain"] = 2.0


SCALE = {"value": 2.0}


@functools.cache
def unbounded_scale() -> float:
    return SCALE["value"]


@functools.lru_cache(maxsize=8)
def bounded_scale() -> float:
    return SCALE["value"]


class CachedScale(nn.Module):
    def __init__(self, scale) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale()


@pytest.mark.parametrize("scale", [unbounded_scale, bounded_scale], ids=["cache", "lru_cache"])
@pytest.mark.parametrize("how", ["capture", "compile"])
def test_a_functools_cache_filled_by_the_capture_keeps_its_real_result(how, scale):
    # Eager computes the cached value once and keeps it, whatever the state it came from holds later.
    torch.manual_seed(0)
    model, x = CachedScale(scale), torch.randn(2, 4)

    def calls(fn):
        scale.cache_clear()
        SCALE["value"] = 2.0
        outs = [fn(x)]
        SCALE["value"] = 5.0
        outs += [fn(x), model(x)]
        return outs

    try:
        expected = calls(model)
        if how == "capture":
            scale.cache_clear()
            SCALE["value"] = 2.0
            cap = stampout.capture(model, x)
            SCALE["value"] = 5.0
            got = [cap(x), cap(x), model(x)]
        else:
            got = calls(stampout.compile(model, backend="eager"))
    finally:
        SCALE["value"] = 2.0
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


@functools.cache
def cached_noise() -> torch.Tensor:
    return torch.randn(4)


class CachedNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + cached_noise()


def test_a_cached_random_tensor_is_drawn_once_as_in_eager():
    def calls(fn):
        torch.manual_seed(1)
        cached_noise.cache_clear()
        x = torch.randn(2, 4)
        return [fn(x), fn(x), fn(x), torch.randn(3)]  # (the stream after: drawn from once)

    torch.manual_seed(0)
    model = CachedNoise()
    expected = calls(model)
    for g, e in zip(calls(stampout.compile(model, backend="eager")), expected):
        torch.testing.assert_close(g, e)
    assert type(cached_noise()) is torch.Tensor


def test_capture_refuses_a_cached_random_tensor():
    torch.manual_seed(0)
    model, x = CachedNoise(), torch.randn(2, 4)
    cached_noise.cache_clear()
    with pytest.raises(stampout.StampoutError, match="functools cache of cached_noise"):
        stampout.capture(model, x)
    assert cached_noise.cache_info().currsize == 0  # (no traced value left in it)


@pytest.mark.parametrize("scale", [unbounded_scale, bounded_scale], ids=["cache", "lru_cache"])
def test_a_cleared_functools_cache_is_seen_by_later_calls(scale):
    # (a hit's result is in the graph: clearing the cache between calls makes eager compute it again)
    torch.manual_seed(0)
    model, x = CachedScale(scale), torch.randn(2, 4)
    scale.cache_clear()
    SCALE["value"] = 2.0
    try:
        model(x)  # (filled before the capture: the capture hits it)
        fn = stampout.compile(model, backend="eager")
        for value, clear in ((5.0, False), (5.0, False), (5.0, True), (7.0, False), (7.0, True)):
            SCALE["value"] = value
            if clear:
                scale.cache_clear()
            torch.testing.assert_close(fn(x), model(x))
    finally:
        SCALE["value"] = 2.0


@functools.cache
def cached_angles(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(n, dtype=torch.float32) / n
    return t.cos(), t.sin()


class CachedAngles(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = cached_angles(x.shape[-1])
        return self.lin(x) * cos + sin


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_tensor_a_functools_cache_held_before_the_compile_is_read_from_it(backend):
    # (a hit on a real tensor: compiled, the tensor read per call; before, such programs always ran eagerly. A
    # bounded lru_cache does not show its results to Python: such a program still runs eagerly)
    torch.manual_seed(0)
    model, x = CachedAngles(), torch.randn(2, 4)
    cached_angles.cache_clear()
    model(x)  # eager fills the cache
    fn = stampout.compile(model, backend=backend)
    torch.testing.assert_close(fn(x), model(x))
    assert fn.stats.captures == 1 and "runs eagerly" not in fn.explain()
    cached_angles(4)[0].mul_(3.0)  # the cached tensor changed in place: read as it is now
    torch.testing.assert_close(fn(x), model(x))
    cached_angles(4)[1].data = torch.full((4,), 0.25)
    torch.testing.assert_close(fn(x), model(x))
    cached_angles.cache_clear()  # eager computes it again, once: that call runs eagerly (its trace would keep a
    torch.testing.assert_close(fn(x), model(x))  # traced value) and fills the cache; the next captures and hits it
    torch.testing.assert_close(fn(x), model(x))
    captures = fn.stats.captures
    torch.testing.assert_close(fn(x), model(x))
    assert fn.stats.captures == captures and "keeps a traced value" in fn.explain()
    cached_angles(4)[1].data = torch.ones(2)  # another shape
    with pytest.raises(RuntimeError):
        model(x)
    with pytest.raises(RuntimeError):
        fn(x)


@functools.cache
def cached_table(n: int) -> types.SimpleNamespace:
    t = torch.arange(n, dtype=torch.float32) / n
    return types.SimpleNamespace(cos=t.cos(), sin=t.sin())


class CachedTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = cached_table(x.shape[-1])
        return self.lin(x) * table.cos + table.sin


@pytest.mark.parametrize("how", ["capture", "compile"])
def test_a_traced_tensor_on_an_object_a_functools_cache_returns_is_taken_out(how):
    # The capture fills the cache with an object holding traced tensors. Finding the fakes a cache holds used to
    # open only lists, tuples and dicts (world.py's scan also opens objects and sets): the object kept its fakes,
    # and the next eager call computed with a FakeTensor.
    torch.manual_seed(0)
    model, x = CachedTable(), torch.randn(2, 4)
    cached_table.cache_clear()
    expected = model(x)
    cached_table.cache_clear()
    fn = stampout.capture(model, x) if how == "capture" else stampout.compile(model, backend="eager")
    torch.testing.assert_close(fn(x), expected)
    held = [v for v in vars(cached_table(4)).values()]
    assert all(type(t) is torch.Tensor for t in held), [type(t) for t in held]
    torch.testing.assert_close(model(x), expected)
    torch.testing.assert_close(fn(x), expected)


class _Stats:
    def __init__(self) -> None:
        self.hits = 0


class _CountsInDict:
    def __init__(self) -> None:
        self.__dict__["hits"] = 0
        self.__dict__["values"] = {"scale": 2.0}

    def __getattr__(self, name: str):
        self.__dict__["hits"] += 1
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def seen(self) -> int:
        return self.hits


class _CountsOnAnObject:
    def __init__(self) -> None:
        self.stats, self.values = _Stats(), {"scale": 2.0}

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        self.stats.hits += 1
        return self.values[name]

    def seen(self) -> int:
        return self.stats.hits


class _Logs:
    def __init__(self) -> None:
        self.log, self.values = [], {"scale": 2.0}

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        self.log.append(name)
        return self.values[name]

    def seen(self) -> int:
        return len(self.log)


class _ReadsThrough(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.cfg.scale


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("cfg_class", [_CountsInDict, _CountsOnAnObject, _Logs])
def test_a_getattr_with_side_effects_runs_once_per_call_as_in_eager(cfg_class, backend):
    """A user `__getattr__` that counts or logs: its effect happens once per call, as eager's (was: twice on the
    first call, stampout's own probes and guards running it; on every call for a log)."""
    torch.manual_seed(0)
    model = _ReadsThrough(cfg_class())
    reference = _ReadsThrough(cfg_class())
    reference.load_state_dict(model.state_dict())
    fn = stampout.compile(model, backend=backend)
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(fn(x), reference(x))
        assert model.cfg.seen() == reference.cfg.seen()
        model.cfg.values["scale"] += 1.0  # (and a value it serves changed between calls: seen)
        reference.cfg.values["scale"] += 1.0


class _Proxy:
    def __init__(self) -> None:
        self._values = {"scale": 2.0}

    def __getattr__(self, name: str):
        return object.__getattribute__(self, "_values")[name]  # (a read behind the watched lookup)


class _Direct:
    def __init__(self) -> None:
        self.scale = 2.0


class _ReadsBehind(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * object.__getattribute__(self.cfg, "scale")


@pytest.mark.parametrize("make", [lambda: _ReadsThrough(_Proxy()), lambda: _ReadsBehind(_Direct())],
                         ids=["proxy __getattr__", "in forward"])
def test_a_read_through_object_getattribute_is_not_baked(make):
    """`object.__getattribute__(obj, name)` is a slot wrapper no watch sees: the program runs eagerly (was: the
    value read at capture, returned by every later call)."""
    torch.manual_seed(0)
    model = make()
    fn = stampout.compile(model, backend="eager")
    values = model.cfg._values if isinstance(model.cfg, _Proxy) else model.cfg.__dict__
    for scale in (2.0, 3.0, 5.0):
        values["scale"] = scale
        x = torch.randn(2, 4)
        torch.testing.assert_close(fn(x), model(x))


class OwnCachedNoise(nn.Module):
    def __init__(self, bounded: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.flag = True  # (other fields beside the cache)
        self.noise = (functools.lru_cache(maxsize=2) if bounded else functools.cache)(lambda: torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.noise()


@pytest.mark.parametrize("bounded", [False, True], ids=["cache", "lru_cache"])
def test_capture_refuses_a_random_tensor_cached_by_a_cache_only_the_module_holds(bounded):
    torch.manual_seed(0)
    model, x = OwnCachedNoise(bounded), torch.randn(2, 4)
    with pytest.raises(stampout.StampoutError, match="functools cache of"):
        stampout.capture(model, x)
    assert model.noise.cache_info().currsize == 0  # (no traced value left in it)
