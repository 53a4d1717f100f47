"""Guards shared by every call of a reuse entry (guards/entry.py): checked once, re-checked after any write.

Between two layer calls of ONE forward the outer program rebinds a global, patches a class, swaps a
function's `__code__`/`__defaults__`; each must make the stamped call miss when what the trace read differs,
and reuse when it is put back. Counts are exact, results compared with eager."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_matches_eager
from torch import nn

import stampout
from stampout.guards.entry import EntryCheck

SCALE = 2.0
UNRELATED = 0


def act(x):
    return torch.tanh(x)


def shift(x, k=1.0):
    return x + k


def _relu(x):
    return torch.relu(x)


def _shift_twice(x, k=1.0):
    return x + 2 * k


class Base(nn.Module):
    def post(self, x):
        return x


class Inner(Base):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.post(self.lin(x))


def _post_negated(self, x):
    return -x


def _inner_doubled(self, x):
    return self.lin(x) * 2


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    @stampout.region
    def forward(self, x):
        return shift(act(self.inner(x)) * SCALE)


_ORIGINAL = (Inner.forward, act.__code__, shift.__defaults__, Base.post)


class Net(nn.Module):
    def __init__(self, flip, n=6):
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(n)])
        self.flip = flip

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            self.flip(i)
            x = layer(x)
        return x


@pytest.fixture(autouse=True)
def restore():
    yield
    global SCALE, UNRELATED
    SCALE, UNRELATED = 2.0, 0
    Inner.forward, act.__code__, shift.__defaults__, Base.post = _ORIGINAL
    if "some_attribute" in Inner.__dict__:
        del Inner.some_attribute


def set_scale(i):
    global SCALE
    SCALE = 3.0 if i == 3 else 2.0  # layer 3 differs, 4.. are as before: they reuse the first entry


def set_act(i):
    act.__code__ = _relu.__code__ if i == 3 else _ORIGINAL[1]


def set_defaults(i):
    shift.__defaults__ = (5.0,) if i == 3 else _ORIGINAL[2]


def patch_class(i):
    Inner.forward = _inner_doubled if i == 3 else _ORIGINAL[0]


def patch_base_class(i):
    Base.post = _post_negated if i == 3 else _ORIGINAL[3]  # a class along the MRO of the class guarded


def rebind_same(i):
    global SCALE, UNRELATED
    SCALE = 4.0 / 2  # writes to the globals dict and the class dict: the shared guards run again, and hold
    UNRELATED = i
    Inner.some_attribute = float(i > 99)  # (a new object each time: a write CPython counts)


@pytest.mark.parametrize("flip, traces", [
    (set_scale, 2), (set_act, 2), (set_defaults, 2), (patch_class, 2), (patch_base_class, 2),
    (rebind_same, 1),
])
def test_flip_between_layer_calls_of_one_forward(flip, traces):
    cap = assert_matches_eager(Net(flip), torch.randn(2, 4))
    assert (cap.stats.traces, cap.stats.reuses) == (traces, 6 - traces)
    for entry in cap.reuse_entries:
        assert isinstance(entry.check, EntryCheck)


def test_patched_class_stays_patched_for_later_layers():
    def flip(i):
        Inner.forward = _inner_doubled if i >= 3 else _ORIGINAL[0]

    cap = assert_matches_eager(Net(flip), torch.randn(2, 4))
    assert (cap.stats.traces, cap.stats.reuses) == (2, 4)


def test_write_without_change_reruns_shared_guards_only_then():
    counts = []

    def flip(i):
        global UNRELATED
        if i == 3:
            UNRELATED += 1

    model = Net(flip)
    cap = stampout.capture(model, torch.randn(2, 4))
    (entry,) = cap.reuse_entries
    counts.append(entry.check.shared_checks)
    assert (cap.stats.traces, cap.stats.reuses) == (1, 5)
    assert counts == [2]  # once armed at layer 1's stamped call, once after the write before layer 3


def test_flip_between_captures():
    model = Net(lambda i: None)
    x = torch.randn(2, 4)
    first = stampout.capture(model, x)
    assert (first.stats.traces, first.stats.reuses) == (1, 5)
    for change in (lambda: set_scale(3), lambda: set_act(3), lambda: set_defaults(3), lambda: patch_class(3)):
        change()
        cap = assert_matches_eager(model, x)
        assert (cap.stats.traces, cap.stats.reuses) == (1, 5)


def test_compiled_function_misses_after_flip_between_calls():
    model = Net(lambda i: None)
    x = torch.randn(2, 4)
    compiled = stampout.compile(model, backend="eager")
    torch.testing.assert_close(compiled(x), model(x))
    for change in (lambda: set_scale(3), lambda: set_act(3), lambda: set_defaults(3), lambda: patch_class(3)):
        change()
        torch.testing.assert_close(compiled(x), model(x))


def _helper(x):
    return x + 1


def _other(x):
    return x * 10


def test_a_called_function_whose_code_is_replaced_recaptures():
    def f(x):
        return _helper(x)

    compiled = stampout.compile(f, backend="eager")
    x = torch.ones(2)
    torch.testing.assert_close(compiled(x), f(x))
    code = _helper.__code__
    _helper.__code__ = _other.__code__
    try:
        torch.testing.assert_close(compiled(x), f(x))  # got x + 1
    finally:
        _helper.__code__ = code
