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


class Tagged(torch.Tensor):
    pass


class SubclassBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 if isinstance(x, Tagged) else y


def test_a_tensor_subclass_input_runs_eagerly_and_capture_refuses(caplog):
    torch.manual_seed(0)
    model = SubclassBranch()
    fn = stampout.compile(model, backend="eager")
    with caplog.at_level(logging.WARNING, logger="stampout"):
        for tag in (False, True, False):
            x = torch.randn(2, 4)
            x = x.as_subclass(Tagged) if tag else x
            torch.testing.assert_close(fn(x).as_subclass(torch.Tensor), model(x).as_subclass(torch.Tensor))
    assert any("Tagged" in r.getMessage() for r in caplog.records)
    with pytest.raises(stampout.CaptureError, match="Tagged"):
        stampout.capture(model, torch.randn(2, 4).as_subclass(Tagged))


class SavedHooks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 2, lambda t: t):
            return self.lin(x).tanh() * x


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_saved_tensors_hooks_inside_forward_keep_their_gradients(backend):
    torch.manual_seed(0)
    model = SavedHooks()
    compiled_model = copy.deepcopy(model)
    fn = stampout.compile(compiled_model, backend=backend)
    x = torch.randn(2, 4, requires_grad=True)
    xc = x.detach().clone().requires_grad_(True)
    model(x).sum().backward()
    fn(xc).sum().backward()
    torch.testing.assert_close(xc.grad, x.grad)
    for a, b in zip(compiled_model.parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


class SwapsChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU()
        self.lin = nn.Linear(4, 4)
        self.n = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        if self.n == 2:
            self.act = nn.Tanh()  # (made during the call: a compiled call cannot make it again)
        return self.act(self.lin(x))


def test_storing_a_module_made_during_the_call_is_refused_not_dropped():
    torch.manual_seed(0)
    model = SwapsChild()
    fn = stampout.compile(model, backend="eager")
    fn(torch.randn(2, 4))
    with pytest.raises(stampout.StampoutError, match="stores a Tanh made during the call"):
        fn(torch.randn(2, 4))
    assert type(model.act) is nn.ReLU and model.n == 1  # (the refused capture left the model as it was)


class Penalty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)
        y = self.lin(x).sigmoid().sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        return y + g.pow(2).sum()


def test_a_gradient_penalty_under_aot_eager_gives_eager_gradients():
    torch.manual_seed(0)
    model = nn.ModuleList([Penalty(), Penalty()])
    compiled_model = copy.deepcopy(model)

    def run(layers):
        return sum(layer(x) for layer in layers)

    x = torch.randn(3, 4)
    fn = stampout.compile(compiled_model[0], backend="aot_eager")
    fn(x).backward()  # (double backward through a compiled child: AOTAutograd refuses)
    model[0](x).backward()
    for a, b in zip(compiled_model[0].parameters(), model[0].parameters()):
        torch.testing.assert_close(a.grad, b.grad)


class LazyHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleDict()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = str(x.shape[-1])
        if key not in self.heads:
            self.heads[key] = nn.Linear(x.shape[-1], 2)
        return self.heads[key](x)


def test_a_submodule_made_during_the_call_is_refused_by_capture_and_run_eagerly_by_compile(caplog):
    model = LazyHeads()
    with pytest.raises(stampout.CaptureError, match="ModuleDict.3, a module it makes during the call"):
        stampout.capture(model, torch.randn(2, 3))
    assert len(model.heads) == 0
    fn = stampout.compile(model, backend="eager")
    with caplog.at_level(logging.WARNING, logger="stampout"):
        for d in (3, 4, 3):
            x = torch.randn(2, d)
            torch.testing.assert_close(fn(x), model(x))
    assert sorted(model.heads) == ["3", "4"]
    assert any("a module it makes during the call" in r.getMessage() for r in caplog.records)
    assert all(type(p) is nn.Parameter and not isinstance(p, torch._subclasses.FakeTensor)
               for p in model.parameters())


class Log:
    def __init__(self) -> None:
        self.calls = 0
        self.log = [{"rows": []}]


def fills_nested(x: torch.Tensor, cfg: Log) -> torch.Tensor:
    cfg.calls += 1
    cfg.log[0]["rows"].append(x.shape[0])  # (a list inside a dict inside a list: changed through subscripts)
    return x * cfg.calls


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_list_nested_in_constants_of_a_caller_object_is_filled_every_call(dynamic):
    fn = stampout.compile(fills_nested, backend="eager", dynamic=dynamic)
    mine, theirs = Log(), Log()
    for n in (2, 3, 2):
        x = torch.randn(n)
        torch.testing.assert_close(fn(x, mine), fills_nested(x, theirs))
        assert (mine.calls, mine.log) == (theirs.calls, theirs.log)
        assert all(type(v) is int for v in mine.log[0]["rows"])


class InferenceForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2


def test_inference_mode_inside_forward_gives_inference_tensors():
    torch.manual_seed(0)
    model = InferenceForward()
    fn = stampout.compile(model, backend="eager")
    for _ in range(2):
        x = torch.randn(2, 4)
        got, expected = fn(x), model(x)
        torch.testing.assert_close(got, expected)
        assert got.is_inference() and not got.requires_grad


class SetsDefaultDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.set_default_dtype(torch.float64)
        return self.lin(x) + torch.ones(4).float()


def test_a_default_dtype_set_inside_forward_is_set_by_every_call():
    torch.manual_seed(0)
    fn = stampout.compile(SetsDefaultDtype(), backend="eager")
    try:
        for _ in range(2):
            torch.set_default_dtype(torch.float32)
            fn(torch.randn(2, 4))
            assert torch.get_default_dtype() is torch.float64
    finally:
        torch.set_default_dtype(torch.float32)


def test_capture_refuses_saved_tensors_hooks_set_inside_the_program():
    torch.manual_seed(0)
    with pytest.raises(stampout.CaptureError, match="saved_tensors_hooks"):
        stampout.capture(SavedHooks(), torch.randn(2, 4, requires_grad=True))


def test_saved_tensors_hooks_around_a_capture_still_apply_when_it_runs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(2, 4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 3, lambda t: t):
        cap = stampout.capture(model, x)
        xc = x.detach().clone().requires_grad_(True)
        cap(xc).sum().backward()
        model(x).sum().backward()
    torch.testing.assert_close(xc.grad, x.grad)


_EXEC_SOURCE = '''
class Counted(nn.Module):
    CALLS = 0

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        type(self).CALLS += 1
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return self.lin(x)
'''


def test_a_class_made_by_exec_has_its_counter_put_back_when_a_piece_capture_fails():
    g = {"__name__": "not_imported_module", "torch": torch, "nn": nn}
    exec(compile(_EXEC_SOURCE, "<generated>", "exec"), g)  # noqa: S102 - a module that is not in sys.modules
    model = nn.Sequential(*[g["Counted"]() for _ in range(3)])
    fn = stampout.compile(model, backend="eager")
    fn(torch.randn(2, 4))
    assert g["Counted"].CALLS == 3  # (eager: one per layer; the failed captures' increments are put back)


def test_capture_of_spectral_norm_leaves_its_power_iteration_buffers_alone():
    # (spectral_norm's pre-hook stores `module.weight` (made real, as eager) and updates u, v in place: a
    # capture does not touch real tensors, as with BatchNorm's statistics; the Capture's first call does)
    torch.manual_seed(0)
    model = nn.Sequential(torch.nn.utils.spectral_norm(nn.Linear(4, 4)), nn.Tanh())
    ref = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 4)
    cap = stampout.capture(model, x)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])
    torch.testing.assert_close(cap(x), ref(x))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ref.state_dict()[k])


def test_compile_says_why_saved_tensors_hooks_in_forward_run_eagerly(caplog):
    torch.manual_seed(0)
    fn = stampout.compile(SavedHooks(), backend="eager")
    with caplog.at_level(logging.WARNING, logger="stampout"):
        fn(torch.randn(2, 4, requires_grad=True))
    assert any("saved_tensors_hooks" in r.getMessage() and "eagerly" in r.getMessage() for r in caplog.records)
