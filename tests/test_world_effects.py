"""The world outside the watched objects (SPEC §3): impure calls are never baked, no fake tensor or symbolic
size is left in user state after a capture, RNG states are put back, and autograd registrations made during
a call give eager's gradients (or an explicit StampoutError / an eager run with a warning).

Every case runs the same program eagerly on a copy and compares values, gradients and the world afterwards.
"""

from __future__ import annotations

import copy
import datetime
import functools
import logging
import os
import random
import secrets
import sys
import time
import types
import uuid

import numpy as np
import pytest
import torch
from helpers import tree_assert_close
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import stampout

D = 4
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _x(grad: bool = False) -> torch.Tensor:
    return torch.randn(2, D, generator=torch.Generator().manual_seed(3)).requires_grad_(grad)


def fakes_in(value, depth: int = 0) -> list[str]:
    """Paths to FakeTensors / SymInts inside `value` (containers, plain objects, module dicts)."""
    if isinstance(value, FakeTensor) or isinstance(value, (torch.SymInt, torch.SymFloat)):
        return ["<here>"]
    if depth > 4 or isinstance(value, (torch.Tensor, type, types.ModuleType)) or callable(value) and not \
            isinstance(value, nn.Module):
        return []
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple, set)):
        items = list(enumerate(value))
    elif isinstance(getattr(value, "__dict__", None), dict):
        items = list(vars(value).items())
    else:
        return []
    return [f"{k}.{p}" for k, v in items for p in fakes_in(v, depth + 1)]


def assert_clean(*roots) -> None:
    for root in roots:
        found = fakes_in(root)
        assert not found, f"fakes left in user state: {found}"


# ------------------------------------------------------------------------------- family 2: impure calls

_GEN = (i for i in range(10**6))
_SYS_RNG = random.Random(5)

DRAWS = {
    "random.random": lambda: random.random(),
    "random.randint": lambda: random.randint(0, 9) / 9,
    "random.uniform": lambda: random.uniform(0, 1),
    "random.choice": lambda: random.choice([0.1, 0.7]),
    "Random.random": lambda: _SYS_RNG.random(),
    "numpy.random.rand": lambda: float(np.random.rand()),
    "time.time": lambda: time.time() % 1,
    "time.perf_counter": lambda: time.perf_counter() % 1,
    "uuid.uuid4": lambda: uuid.uuid4().int % 97 / 97,
    "os.urandom": lambda: os.urandom(1)[0] / 255,
    "secrets.randbelow": lambda: secrets.randbelow(100) / 100,
    "next(generator)": lambda: next(_GEN) % 7 / 7,
    "datetime.now": lambda: datetime.datetime.now().microsecond / 1e6,
}
SEEDED = {"random.random", "random.randint", "random.uniform", "random.choice", "numpy.random.rand"}


class Dice(nn.Module):
    """Stochastic depth: a Python-side draw (`DRAWS[self.kind]`) decides per call."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.kind = kind

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if DRAWS[self.kind]() < 0.5:
            h = h * -2.0
        return x + torch.tanh(h)


def _dice_stack(name: str, n: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Dice(name) for _ in range(n)])


def _seed(s: int) -> None:
    random.seed(s)
    np.random.seed(s)


@pytest.mark.parametrize("name", sorted(DRAWS))
def test_impure_call_in_a_region_is_traced_per_call(name: str) -> None:
    model = _dice_stack(name)
    ref = copy.deepcopy(model)
    _seed(1)
    cap = stampout.capture(model, _x())
    assert cap.stats.reuses == 0, cap.explain()
    assert any("not known to be pure" in e.ineligible or "cannot guard" in e.ineligible for e in cap.events)
    if name in SEEDED:
        after = (random.getstate(), np.random.get_state()[1].tolist())
        _seed(1)
        assert after == (random.getstate(), np.random.get_state()[1].tolist()), "the capture consumed RNG state"
        tree_assert_close(cap(_x()), ref(_x()), **TOL)  # the capture's draws are eager's first call's


def _only_pieces_without_the_draw_compiled(fn) -> bool:
    """The module whose code draws ran eagerly: the last graph that ran (a compiled module reports its pieces')
    is none, or that of a child Linear, compiled piecewise."""
    return fn.last_capture is None or isinstance(fn.last_capture.fn, nn.Linear)


@pytest.mark.parametrize("name", sorted(DRAWS))
def test_impure_call_makes_compile_run_eagerly_with_a_warning(name: str, caplog) -> None:
    model = _dice_stack(name)
    ref = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager")
    _seed(2)
    with caplog.at_level(logging.WARNING, logger="stampout"):
        outs = [fn(_x()) for _ in range(8)]
    assert _only_pieces_without_the_draw_compiled(fn)  # every call ran the drawing code eagerly
    assert "runs eagerly" in caplog.text, caplog.text
    if "not known to be pure" in caplog.text:
        assert f"{__file__}:" in caplog.text, caplog.text
    else:  # an object with hidden state (a Random, numpy's cython functions), read by the program
        assert "cannot guard" in caplog.text, caplog.text
    if name in SEEDED:
        _seed(2)
        for out in outs:
            tree_assert_close(out, ref(_x()), **TOL)
        assert len({tuple(o.flatten().tolist()) for o in outs}) > 1
        state = random.getstate()
        _seed(2)
        for _ in range(8):
            ref(_x())
        assert random.getstate() == state


def test_impure_call_is_named_in_the_reason() -> None:
    cap = stampout.capture(_dice_stack("time.time", 2), _x())
    reasons = " ".join(e.ineligible for e in cap.events)
    assert "time.time" in reasons and f"{__file__}:" in reasons, reasons


def test_randint_is_caught_inside_the_standard_library() -> None:
    """random.randint is Python calling the C getrandbits: the call is seen in the stdlib frame."""
    cap = stampout.capture(_dice_stack("random.randint", 2), _x())
    assert "getrandbits" in cap.events[0].ineligible, cap.events[0].ineligible


class PureLayer(nn.Module):
    TABLE = {"a": 0.5}

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = math_scale(len("ab"), self.TABLE.get("a"))
        name = "{}-{}".format("h", str(3).zfill(2)).upper()
        parts = sorted([3, 1, 2]) + list(reversed(range(2)))
        return x + torch.tanh(self.fc(x)) * s * (len(name) + sum(parts) - 13)


def math_scale(n: int, s: float) -> float:
    import math

    return math.sqrt(n * n) * s * abs(-1) * max(1, min(2, 3)) * round(1.2)


def test_pure_calls_keep_reuse() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[PureLayer() for _ in range(4)])
    ref = copy.deepcopy(model)
    cap = stampout.capture(model, _x())
    assert (cap.stats.traces, cap.stats.reuses) == (1, 3), cap.explain()
    tree_assert_close(cap(_x()), ref(_x()), **TOL)
    fn = stampout.compile(model, backend="eager")
    tree_assert_close(fn(_x()), ref(_x()), **TOL)
    assert fn.last_capture is not None


def test_users_profiler_and_tracer_survive_a_capture() -> None:
    events: list[str] = []

    def profiler(frame, event, arg):
        events.append(event)

    def tracer(frame, event, arg):
        return None

    sys.setprofile(profiler)
    sys.settrace(tracer)
    try:
        stampout.capture(_dice_stack("random.random", 2), _x())
        assert sys.getprofile() is profiler and sys.gettrace() is tracer
    finally:
        sys.setprofile(None)
        sys.settrace(None)
    assert "c_call" in events  # it kept getting its events during the capture


def test_torch_rng_state_put_back() -> None:
    def program(x):
        torch.manual_seed(123)
        return x + torch.rand(D)

    torch.manual_seed(7)
    with pytest.raises(stampout.CaptureError, match="random number generator"):  # (its graph could not reseed)
        stampout.capture(program, _x())
    after = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(3))


def test_torch_manual_seed_in_a_compiled_program_runs_eagerly() -> None:
    def program(x):
        torch.manual_seed(123)
        return x + torch.rand(D)

    fn = stampout.compile(program, backend="eager")
    a = fn(_x())
    torch.rand(5)
    b = fn(_x())
    assert torch.equal(a, b) and fn.last_capture is None


# ------------------------------------------------------------------ family 1: fakes left in user state

metrics = types.ModuleType("metrics_for_world_effects")  # a module used as a namespace by the program
metrics.LAST = None
MEMO: dict = {}
LIST_MEMO: list = []
LAST_SUM = None


@functools.cache
def rope_table(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) / 10


@functools.cache
def causal(n: int) -> torch.Tensor:
    return torch.ones(n) * 0.5


def dict_memo(n: int) -> torch.Tensor:
    if n not in MEMO:
        MEMO[n] = torch.ones(n) * 3
    return MEMO[n]


def list_memo(n: int) -> torch.Tensor:
    if not LIST_MEMO:
        LIST_MEMO.append(torch.ones(n) * 0.25)
    return LIST_MEMO[0]


class Memo(nn.Module):
    """One memo pattern per subclass (`body`), used by a region layer."""

    _masks: dict = {}

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x) + self.body(x))


class LruGlobal(Memo):
    def body(self, x):
        return rope_table(D)


class CacheGlobal(Memo):
    def body(self, x):
        return causal(D)


class DictGlobal(Memo):
    def body(self, x):
        return dict_memo(D)


class ListGlobal(Memo):
    def body(self, x):
        return list_memo(D)


class ClassDict(Memo):
    def body(self, x):
        if D not in self._masks:
            self._masks[D] = torch.ones(D) * 4
        return self._masks[D]


class LruMethod(Memo):
    @functools.cache  # noqa: B019 - the pattern under test
    def table(self, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32) / 7

    def body(self, x):
        return self.table(D)


class CachedProperty(Memo):
    @functools.cached_property
    def scale(self) -> torch.Tensor:
        return torch.ones(D) * 2

    def body(self, x):
        return self.scale


class NamespaceStore(Memo):
    def body(self, x):
        metrics.LAST = x.shape[0]
        return 0.0


class GlobalStore(Memo):
    def body(self, x):
        global LAST_SUM
        LAST_SUM = x.sum()
        return 0.0


MEMOS = [LruGlobal, CacheGlobal, DictGlobal, ListGlobal, ClassDict, LruMethod, CachedProperty, NamespaceStore,
         GlobalStore]


def _reset_memos() -> None:
    global LAST_SUM
    MEMO.clear()
    LIST_MEMO.clear()
    Memo._masks.clear()
    rope_table.cache_clear()
    causal.cache_clear()
    LruMethod.table.cache_clear()
    metrics.LAST = None
    LAST_SUM = None


def _memo_world(model: nn.Module) -> list:
    return [MEMO, LIST_MEMO, Memo._masks, metrics.LAST, LAST_SUM, *(vars(m) for m in model.modules())]


def _memo_stack(cls: type) -> nn.Module:
    _reset_memos()
    torch.manual_seed(0)
    return nn.Sequential(*[cls() for _ in range(3)])


@pytest.mark.parametrize("cls", MEMOS, ids=lambda c: c.__name__)
def test_capture_leaves_no_fake_in_user_state(cls: type) -> None:
    model = _memo_stack(cls)
    ref = copy.deepcopy(model)
    x = _x(grad=True)
    cap = stampout.capture(model, x)
    assert_clean(_memo_world(model), rope_table.cache_info(), causal.cache_info())
    for fn in (rope_table, causal, LruMethod.table):  # a cache keeps no result computed on fakes
        assert fn.cache_info().currsize == 0 or cls not in (LruGlobal, CacheGlobal, LruMethod)
    tree_assert_close(cap(_x()), ref(_x()), **TOL)
    tree_assert_close(model(_x()), ref(_x()), **TOL)  # the next eager call works and matches
    assert_clean(_memo_world(model))


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("cls", MEMOS, ids=lambda c: c.__name__)
def test_compile_leaves_the_world_as_eager(cls: type, dynamic) -> None:
    model = _memo_stack(cls)
    ref = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager", dynamic=dynamic)
    for rows in (2, 3, 5, 3):
        x = torch.randn(rows, D)
        expected = ref(x)
        stored = (metrics.LAST, LAST_SUM)
        metrics.LAST = None
        out = fn(x)
        assert_clean(_memo_world(model))
        tree_assert_close(out, expected, **TOL)
        tree_assert_close((metrics.LAST, LAST_SUM), stored, **TOL)  # stored per call, as eager stores them
    tree_assert_close(model(x), ref(x), **TOL)


def test_failed_capture_leaves_no_fake_in_user_state() -> None:
    class Fails(DictGlobal):
        def forward(self, x):
            h = self.body(x) + self.fc(x)
            if h.sum() > 0:  # data-dependent: the capture fails after the memo was filled
                h = h + 1
            return h

    _reset_memos()
    with pytest.raises(stampout.StampoutError):
        stampout.capture(Fails(), _x())
    assert_clean(_memo_world(nn.Module()))


# ------------------------------------------------------------------------ family 3: autograd registrations


class Hooked(nn.Module):
    """Registers a gradient hook inside forward: on an intermediate, on its input, or on a parameter."""

    def __init__(self, where: str, region: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.where = where
        self.scale = -3.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.where == "intermediate":
            h.register_hook(lambda g: g * self.scale)
        elif self.where == "input":
            x.register_hook(lambda g: g * 0.5)
        elif self.where == "parameter":
            self.fc.weight.register_hook(lambda g: g * 2.0)
        return torch.tanh(h) * x


class HookedRegion(Hooked):
    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def _grads_of(run, model: nn.Module) -> tuple:
    for p in model.parameters():
        p.grad = None
    x = _x(grad=True)
    out = run(x)
    (out.float() ** 2).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


WHERE = ["intermediate", "input", "parameter"]


@pytest.mark.parametrize("where", WHERE)
def test_tensor_hook_in_forward_capture(where: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Hooked(where), Hooked("none"))
    ref = copy.deepcopy(model)
    cap = stampout.capture(model, _x(grad=True))
    tree_assert_close(_grads_of(cap, model), _grads_of(ref, ref), **TOL)
    tree_assert_close(_grads_of(cap, model), _grads_of(ref, ref), **TOL)  # a second call registers again


@pytest.mark.parametrize("where", WHERE)
def test_tensor_hook_in_a_region_is_traced_per_call(where: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[HookedRegion(where) for _ in range(3)])
    ref = copy.deepcopy(model)
    cap = stampout.capture(model, _x(grad=True))
    assert cap.stats.reuses == 0, cap.explain()
    tree_assert_close(_grads_of(cap, model), _grads_of(ref, ref), **TOL)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("where", WHERE)
def test_tensor_hook_in_forward_compile(where: str, backend: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[HookedRegion(where) for _ in range(2)])
    ref = copy.deepcopy(model)
    fn = stampout.compile(model, backend=backend)
    for _ in range(2):
        tree_assert_close(_grads_of(fn, model), _grads_of(ref, ref), **TOL)


def test_hook_closing_over_a_traced_tensor_is_refused() -> None:
    def program(x):
        h = x * 2
        mask = h > 0
        h.register_hook(lambda g: g * mask)
        return h.sum()

    with pytest.raises(stampout.StampoutError, match="closes over a tensor"):
        stampout.capture(program, _x(grad=True))


def _backward_hooked(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Hooked("none"), Hooked("none"))
    if kind == "full":
        model[0].register_full_backward_hook(lambda m, gi, go: (gi[0] * 3,))
    else:
        model[1].register_full_backward_pre_hook(lambda m, go: (go[0] * -1,))
    return model


@pytest.mark.parametrize("kind", ["full", "pre"])
def test_module_backward_hook_capture_refuses(kind: str) -> None:
    with pytest.raises(stampout.StampoutError, match="backward hook"):
        stampout.capture(_backward_hooked(kind), _x(grad=True))
    with torch.no_grad():  # without gradients there is nothing to lose
        stampout.capture(_backward_hooked(kind), _x())


@pytest.mark.parametrize("kind", ["full", "pre"])
def test_module_backward_hook_compile_runs_eagerly(kind: str, caplog) -> None:
    model = _backward_hooked(kind)
    ref = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager")
    with caplog.at_level(logging.WARNING, logger="stampout"):
        tree_assert_close(_grads_of(fn, model), _grads_of(ref, ref), **TOL)
    assert "backward hook" in caplog.text


@pytest.mark.parametrize("kind", ["full", "pre"])
def test_module_backward_hook_added_after_compile(kind: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Hooked("none"), Hooked("none"))
    ref = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager")
    tree_assert_close(_grads_of(fn, model), _grads_of(ref, ref), **TOL)
    for m in (model, ref):
        if kind == "full":
            m[0].register_full_backward_hook(lambda m, gi, go: (gi[0] * 3,))
        else:
            m[1].register_full_backward_pre_hook(lambda m, go: (go[0] * -1,))
    tree_assert_close(_grads_of(fn, model), _grads_of(ref, ref), **TOL)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")
def test_fsdp2_model_never_loses_gradients(caplog, tmp_path) -> None:
    """FSDP2 reduces gradients with autograd hooks on the unsharded parameters each call makes: capture keeps its
    hooks as graph nodes, compile runs them eagerly around the compiled forwards (one gloo rank)."""
    import datetime as dt

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    # (a file store in the test's own directory, not a TCP port: parallel test workers never collide)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=dt.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))
        ref = copy.deepcopy(model)
        for layer in (model[0], model[2], model):
            fully_shard(layer)
        cap = stampout.capture(model, _x(grad=True))
        (cap(_x()) ** 2).sum().backward()
        (ref(_x()) ** 2).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, **TOL)
            p.grad, q.grad = None, None
        fn = stampout.compile(model, backend="eager")
        with caplog.at_level(logging.INFO, logger="stampout"):  # (FSDP2's designed split: said at INFO)
            out = fn(_x())
        (out ** 2).sum().backward()
        (ref(_x()) ** 2).sum().backward()
        assert "fully_shard" in caplog.text
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.grad is not None
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, **TOL)
    finally:
        dist.destroy_process_group()


class Stateful(nn.Module):
    """Draws from state the module holds: a NumPy Generator, an itertools.count, a random.Random."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        import itertools

        self.fc = nn.Linear(D, D)
        self.kind = kind
        self.gen = np.random.default_rng(0)
        self.counter = itertools.count()
        self.rng = random.Random(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.kind == "numpy_generator":
            return h * float(self.gen.random())
        if self.kind == "count":
            return h * next(self.counter)
        return h * self.rng.random()


@pytest.mark.parametrize("kind", ["numpy_generator", "count", "random_instance"])
def test_compile_capture_consumes_nothing_of_held_state(kind: str) -> None:
    """The compiled program runs eagerly, and its capture stopped before drawing: every call sees eager's
    state (the capture did not advance the generator or the iterator first)."""
    torch.manual_seed(0)
    model = Stateful(kind)
    ref = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager")
    for _ in range(3):
        tree_assert_close(fn(_x()), ref(_x()), **TOL)
    assert _only_pieces_without_the_draw_compiled(fn)


def test_compile_does_not_consume_an_iterator_argument() -> None:
    def program(x, it):
        return x * next(it)

    fn = stampout.compile(program, backend="eager")
    mine, theirs = iter(range(10)), iter(range(10))
    for _ in range(3):
        tree_assert_close(fn(_x(), mine), program(_x(), theirs), **TOL)


def test_symbolic_size_stored_in_a_namespace_is_concrete_after_capture() -> None:
    def program(x):
        metrics.LAST = x.shape[0]
        return x * 2

    x = _x()
    torch._dynamo.mark_dynamic(x, 0)
    stampout.capture(program, x)
    assert type(metrics.LAST) is int and metrics.LAST == x.shape[0]


def _flat_helpers(x: torch.Tensor) -> torch.Tensor:
    return rope_table(D) + dict_memo(D) + list_memo(D) + causal(D)


def test_flat_capture_leaves_no_fake_in_memos() -> None:
    """No region: the snapshot notes the program's code, and the helpers its globals name, before it runs."""

    def program(x):
        return x * _flat_helpers(x)

    _reset_memos()
    cap = stampout.capture(program, _x())
    assert_clean(_memo_world(nn.Module()))
    assert rope_table.cache_info().currsize == 0 and causal.cache_info().currsize == 0
    tree_assert_close(MEMO, {D: torch.ones(D) * 3}, **TOL)  # the real value, as eager leaves it
    tree_assert_close(cap(_x()), program(_x()), **TOL)
