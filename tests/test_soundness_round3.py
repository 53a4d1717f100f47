"""Third red-team round: ordinary programs that were wrong or crashed, each now equal to eager (or run eagerly
with a warning that names why)."""

from __future__ import annotations

import copy
import logging
import types
import warnings
import weakref

import pytest
import torch
from torch import nn

import stampout


def _store_model() -> tuple[type[nn.Module], list]:
    store: list = []

    class Appender(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            store.append(x.shape[0])
            store.append(self.lin(x).detach().sum())
            return self.lin(x)

    Appender.store = store  # the same list, by a second path (a class attribute)
    return Appender, store


@pytest.mark.parametrize("dynamic", [True, False])
def test_a_list_reached_by_two_paths_is_appended_to_once(dynamic):
    cls, store = _store_model()
    torch.manual_seed(0)
    model = cls()
    fn = stampout.compile(copy.deepcopy(model), backend="eager", dynamic=dynamic)
    xs = [torch.randn(n, 4) for n in (2, 3, 5)]
    for x in xs:
        fn(x)
    got = list(store)
    store.clear()
    for x in xs:
        model(x)
    assert [v if isinstance(v, int) else round(float(v), 4) for v in got] == \
        [v if isinstance(v, int) else round(float(v), 4) for v in store]


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


class LazyBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "running"):
            self.register_buffer("running", torch.zeros(4))
        self.running.add_(x.mean(0))
        return self.lin(x) + self.running


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_buffer_registered_in_forward_is_real_and_kept(backend):
    torch.manual_seed(0)
    model = LazyBuffer()
    compiled_model = copy.deepcopy(model)
    fn = stampout.compile(compiled_model, backend=backend)
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(fn(x), model(x))
        assert type(compiled_model.running) is torch.Tensor
        torch.testing.assert_close(compiled_model.running, model.running)
    assert fn.stats.captures == 2  # (the first call registered it; the second reads it as a buffer)
    assert list(compiled_model.state_dict()) == list(model.state_dict())


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


class CountingBase(nn.Module):
    n_calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).n_calls += 1
        return self.lin(x)


@pytest.mark.parametrize("regions", [None, "auto"])
def test_a_class_attribute_counter_counts_every_call(regions, caplog):
    class Counting(CountingBase):
        pass

    model = nn.Sequential(Counting(), Counting(), Counting())
    fn = stampout.compile(model, backend="eager", regions=regions)
    with caplog.at_level(logging.WARNING, logger="stampout"):
        for _ in range(3):
            fn(torch.randn(2, 4))
    assert Counting.__dict__["n_calls"] == 9 and CountingBase.n_calls == 0  # (eager: 3 layers x 3 calls)
    assert any("Counting.n_calls" in r.getMessage() for r in caplog.records)


class Warns(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 2:
            warnings.warn("big batch: slow path", UserWarning, stacklevel=2)
        return self.lin(x)


def test_a_warning_in_forward_is_shown_on_every_call():
    torch.manual_seed(0)
    model = Warns()
    fn = stampout.compile(model, backend="eager")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            fn(torch.randn(3, 4))
    assert sum("big batch" in str(w.message) for w in seen) == 3
