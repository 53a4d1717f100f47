"""A program's Python effects happen on every call, as in eager: a list reached by two paths appended to once, a class
attribute counter, a warning, a list nested in a caller's object, a global log, `self.calls`, Python's RNG in a region,
`inference_mode` and a default dtype set inside forward. Each equals eager (or runs eagerly with a warning that names
why)."""

from __future__ import annotations

import collections
import copy
import logging
import random
import warnings
import weakref

import pytest
import torch
from blocks import D, sample, stack_of
from helpers import TOL, tree_assert_close
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


class AsksInference(nn.Module):
    """Python decisions on a tensor made inside an inference_mode block, asked after it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple:
        with torch.inference_mode():
            t = self.lin(x)
            inside = (t.is_inference(), torch.is_inference_mode_enabled(), t.requires_grad)
        outside = (t.is_inference(), torch.is_inference_mode_enabled(), t.requires_grad)
        return t * (3.0 if t.is_inference() else 1.0), inside, outside


def test_is_inference_of_a_tensor_made_in_inference_mode_answers_as_eager():
    """(Was: capture answered `t.is_inference()` False after the block: the meta fast path asked a fresh meta
    stand-in, not an inference tensor, and baked the wrong branch.)"""
    torch.manual_seed(0)
    model = AsksInference()
    x = torch.randn(2, 4)
    expected = model(x)
    assert expected[1:] == ((True, True, False), (True, False, False))
    tree_assert_close(stampout.capture(model, x)(x), expected)
    fn = stampout.compile(model, backend="eager")
    for _ in range(3):
        tree_assert_close(fn(x), expected)


class BranchesOnInference(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (3.0 if x.is_inference() else 1.0)


class BranchesOnInferenceMode(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (2.0 if torch.is_inference_mode_enabled() else 1.0)


@pytest.mark.parametrize("model", [BranchesOnInference(), BranchesOnInferenceMode()], ids=["tensor", "mode"])
def test_compile_does_not_reuse_a_trace_across_inference_ness(model):
    """`x.is_inference()` has no guard (a compiled program reading it runs eagerly), and inference mode is part of
    the fingerprint beside grad mode (was: a trace made under no_grad was reused inside inference_mode, and one
    made for an inference tensor for a plain one); a capture takes an inference tensor as input (was: torch's
    RuntimeError reading its version)."""
    fn = stampout.compile(model, backend="eager")
    with torch.inference_mode():
        made = torch.ones(3)
    plain = torch.ones(3)
    for _ in range(2):
        for x in (made, plain):
            with torch.no_grad():
                torch.testing.assert_close(fn(x), model(x))
            with torch.inference_mode():
                torch.testing.assert_close(fn(x), model(x))
    torch.testing.assert_close(stampout.capture(model, made)(made), model(made))


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


CALL_LOG: list[str] = []


@stampout.region
def _logged(x: torch.Tensor) -> torch.Tensor:
    CALL_LOG.append("called")
    return x + 1.0


def _logged_prog(x: torch.Tensor) -> torch.Tensor:
    return _logged(_logged(x))


def test_case12_global_list_append_replayed_every_call() -> None:
    """A region appending to a global list appends on every compiled call, as eager does (or the first call
    raises a StampoutError); a silent drop is the failure."""
    CALL_LOG.clear()
    fn = stampout.compile(_logged_prog, backend="eager")
    try:
        for i in range(3):
            before = len(CALL_LOG)
            try:
                out = fn(sample())
            except stampout.StampoutError:
                assert i == 0, "StampoutError is acceptable only at the first call"
                break
            torch.testing.assert_close(out, sample() + 2.0)
            assert len(CALL_LOG) == before + 2, f"call {i}: log grew by {len(CALL_LOG) - before}, eager grows by 2"
    finally:
        CALL_LOG.clear()


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.calls = 0

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x)


def test_case12_self_calls_counter_in_region() -> None:
    """`self.calls += 1` in a region's forward counts every compiled call."""
    model = stack_of(Counting, 2)
    ref = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager")
    for _ in range(3):
        tree_assert_close(fn(sample()), ref(sample()), **TOL)
    assert [m.calls for m in ref] == [3, 3]
    assert [m.calls for m in model] == [3, 3]


def test_case12_self_calls_counter_top_level() -> None:
    """`self.calls += 1` in a compiled module's own forward (no region) counts every call."""

    class Top(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(D, D)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.fc(x) * self.calls

    torch.manual_seed(0)
    model = Top()
    ref = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager")
    for i in range(3):
        tree_assert_close(fn(sample()), ref(sample()), f"call {i}", **TOL)
    assert (ref.calls, model.calls) == (3, 3)


class Dice(nn.Module):
    """LayerDrop-style: a Python RNG decides per call (seeded, so eager is reproducible)."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.rng = rng

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.rng.random() < 0.5:
            h = h * -2.0
        return x + torch.tanh(h)


def test_family_python_rng_in_a_region() -> None:
    """Each region call draws from a Python RNG: a stamped-out call must not skip the draw (or stampout must
    refuse)."""
    torch.manual_seed(0)
    rng = random.Random(0)
    model = nn.Sequential(*[Dice(rng) for _ in range(4)])
    ref = copy.deepcopy(model)  # its own copy of the RNG, in the same state
    try:
        cap = stampout.capture(model, sample())
    except stampout.StampoutError:
        return
    tree_assert_close(cap(sample()), ref(sample()), **TOL)
    assert rng.getstate() == ref[0].rng.getstate(), "the capture drew a different number of values than eager"


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, D, generator=torch.Generator().manual_seed(seed))


def test_a_counter_the_module_fills_counts_every_call():
    class Counts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.stats = collections.Counter()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.stats["calls"] += 1
            return self.lin(x)

    model = Counts()
    fn = stampout.compile(model, backend="eager")
    for _ in range(3):
        fn(_x())
    assert model.stats["calls"] == 3


class _Made:
    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t + 1


class StoresWhatItMakes(nn.Module):
    """Stores into state that outlives the call an object the call makes: no compiled call can repeat that store."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kind = kind
        self.store: dict = {}
        self.kept: list = []
        self.refs: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.kind == "lambda":
            scale = 2.0
            self.fn = lambda t: t * scale
            y = self.fn(y)
        elif self.kind == "callable object":
            self.fn = _Made()
            y = self.fn(y)
        elif self.kind == "module in a dict":
            self.store["act"] = nn.ReLU()
            y = self.store["act"](y)
        elif self.kind == "hook handle":
            self.handle = self.lin.register_forward_hook(lambda m, i, o: None)
            self.handle.remove()
        elif self.kind == "iterator":
            self.steps = iter([1.0, 2.0, 3.0])
            y = y * next(self.steps)
        elif self.kind == "weak value":
            made = _Made()
            self.kept.append(made)
            self.refs[len(self.kept)] = made
        elif self.kind == "dict keyed by a traced tensor":
            self.store[y] = 1
        return y


_MADE_KINDS = ["lambda", "callable object", "module in a dict", "hook handle", "iterator", "weak value",
               "dict keyed by a traced tensor"]


def _made_state(model: StoresWhatItMakes) -> tuple:
    fn = getattr(model, "fn", None)
    return (type(fn).__name__, len(model.store), len(model.kept), len(model.refs), hasattr(model, "handle"),
            next(model.steps, None) if hasattr(model, "steps") else None,
            [type(v).__name__ for v in model.store.values()])


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("kind", _MADE_KINDS)
def test_an_object_made_during_the_call_stored_in_state_runs_eagerly(kind, backend, caplog):
    """(Was: a GuardError on the first call.) The store is not replayable, so the call runs eagerly, as eager."""
    torch.manual_seed(0)
    model, reference = StoresWhatItMakes(kind), StoresWhatItMakes(kind)
    reference.load_state_dict(model.state_dict())
    fn = stampout.compile(model, backend=backend)
    with caplog.at_level(logging.WARNING, logger="stampout.guards"):
        for _ in range(3):
            x = torch.randn(2, 4)
            tree_assert_close(fn(x), reference(x), **TOL)
            assert _made_state(model) == _made_state(reference)
    assert "StoresWhatItMakes runs eagerly" in caplog.text
    with pytest.raises(stampout.CaptureError, match="fullgraph=True"):
        stampout.compile(StoresWhatItMakes(kind), backend=backend, fullgraph=True)(torch.randn(2, 4))


class Swaps(nn.Module):
    """Double buffering: two configs and two submodules swapped each call."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.p, self.q = Log(), Log()
        self.p.scale, self.q.scale = 1.0, 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x) * self.p.scale
        self.a, self.b = self.b, self.a
        self.p, self.q = self.q, self.p
        return y


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_swap_of_two_attributes_stays_a_swap(backend):
    """The replayed stores read their values before the first store, as the program did (was: `self.a` and `self.b`
    both ended up the old `self.b`, and every later call ran with one layer)."""
    torch.manual_seed(0)
    model = Swaps()
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend=backend)
    for _ in range(4):
        x = torch.randn(2, 4)
        tree_assert_close(fn(x), reference(x), **TOL)
        assert model.a is not model.b and model.p is not model.q
        assert (model.p.scale, model.q.scale) == (reference.p.scale, reference.q.scale)
        torch.testing.assert_close(model.a.weight, reference.a.weight)


class BorrowsASlot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.store: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.store["act"] = nn.ReLU()  # read back through a dict item the call fills, then taken out
        y = self.store["act"](self.lin(x))
        del self.store["act"]
        return y


def test_an_object_read_back_through_a_dict_item_the_call_fills_and_empties():
    """The guards on `type(self.store['act'])` name a place empty before each call (was: AttributeError at the first
    call, turning that guard into one on the class)."""
    torch.manual_seed(0)
    model = BorrowsASlot()
    fn = stampout.compile(model, backend="eager")
    for _ in range(3):
        x = torch.randn(2, 4)
        tree_assert_close(fn(x), model(x), **TOL)
        assert model.store == {}
