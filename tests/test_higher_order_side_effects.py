"""Functions of torch.cond / while_loop with Python side effects (a list append, an attribute store): eager refuses
them (torch's UncapturedHigherOrderOpError, nothing stored), so compile runs them eagerly and raises eager's error,
and capture refuses; the world is left as eager leaves it. Pure functions that only read stay captured whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._higher_order_ops.while_loop import while_loop

import stampout

LOG: list[int] = []


class Logs(nn.Module):
    """The true branch appends to a global list, the false one stores an attribute."""

    def __init__(self, effect):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.effect = effect
        self.seen = 0

    def forward(self, x):
        def true_fn(a):
            if self.effect == "append":
                LOG.append(1)
            return self.lin(a).sin()

        def false_fn(a):
            if self.effect == "store":
                self.seen = self.seen + 1
            return self.lin(a).cos()

        return torch.cond(x.sum() > 0, true_fn, false_fn, (x,))


class LoopLogs(nn.Module):
    def forward(self, x):
        def body(i, a):
            LOG.append(1)
            return i + 1, a * 2

        return while_loop(lambda i, a: i < 3, body, (torch.tensor(0), x))[1]


class Counting(nn.Linear):
    def forward(self, x):
        self.seen = getattr(self, "seen", 0) + 1
        return super().forward(x)


class ModuleBranches(nn.Module):
    """Modules as the branches: what the counting one stores on itself is a side effect too."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = Counting(4, 4), nn.Linear(4, 4)

    @property
    def seen(self):
        return getattr(self.a, "seen", 0)

    def forward(self, x):
        return torch.cond(x.sum() > 0, self.a, self.b, (x,))


def _outcome(fn, x, model):
    LOG.clear()
    try:
        fn(x)
        error = None
    except Exception as e:  # noqa: BLE001 - the error's class is what is compared
        error = type(e)
    return error, list(LOG), getattr(model, "seen", None)


CASES = [lambda: Logs("append"), lambda: Logs("store"), LoopLogs, ModuleBranches]
IDS = ["cond-append", "cond-store", "while_loop-append", "cond-modules"]


@pytest.mark.parametrize("make", CASES, ids=IDS)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_behaves_as_eager(make, backend):
    model, ref = make(), make()
    fn = stampout.compile(model, backend=backend)
    for sign in (1, -1, 1):
        x = torch.randn(3, 4).abs() * sign
        expected = _outcome(ref, x, ref)
        assert expected[0] is not None  # (eager refuses it)
        assert _outcome(fn, x, model) == expected


@pytest.mark.parametrize("make", CASES, ids=IDS)
def test_capture_refuses_and_leaves_the_world(make):
    model = make()
    LOG.clear()
    with pytest.raises(stampout.CaptureError, match=r"a function of torch\.(cond|while_loop) has a Python side effect"
                                                    r"[\s\S]*test_higher_order_side_effects.py:\d+"):
        stampout.capture(model, torch.randn(3, 4))
    assert LOG == [] and getattr(model, "seen", 0) == 0


def test_branches_that_only_read_are_captured():
    def f(x):
        return torch.cond(x.sum() > 0, lambda a: a.sin() + len(LOG), lambda a: a.cos(), (x,))

    LOG[:] = [1, 2]
    fn = stampout.compile(f, backend="aot_eager")
    for sign in (1, -1):
        x = torch.randn(3).abs() * sign
        torch.testing.assert_close(fn(x), f(x))
    assert fn.stats.captures == 1 and not fn.breaks
