"""torch.while_loop and torch.cond through AOTAutograd backends (values and gradients as eager, over calls), and a
failure of stampout's own backend on a graph: that program runs eagerly with a warning, never a crash."""

from __future__ import annotations

import pytest
import torch
from helpers import check_call
from torch import nn
from torch._higher_order_ops.while_loop import while_loop

import stampout


class Loop(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x, n):
        _, h = while_loop(lambda i, h: i < n, lambda i, h: (i + 1, torch.tanh(self.lin(h))), (torch.tensor(0), x))
        return h * 2


class Branch(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda a: self.lin(a).sin(), lambda a: self.lin(a).cos(), (x,))


def _differential(make, backend, grad, calls):
    model, ref = make(), make()
    fn = stampout.compile(model, backend=backend)
    for args in calls:
        with torch.set_grad_enabled(grad):
            check_call(ref, fn, *args, grad=grad, compiled_params_of=model, rtol=None, atol=None)
    return fn


@pytest.mark.parametrize("grad", [False, True])
def test_while_loop_aot_eager(grad):
    calls = [(torch.randn(3, 4), torch.tensor(n)) for n in (3, 1, 4)]
    fn = _differential(Loop, "aot_eager", grad, calls)
    assert fn.stats.captures == 1 and not fn.breaks  # (compiled whole: the trip count is data)


@pytest.mark.parametrize("grad", [False, True])
def test_cond_aot_eager(grad):
    calls = [(torch.randn(3, 4).abs() * s,) for s in (1, -1, 1, -1)]
    fn = _differential(Branch, "aot_eager", grad, calls)
    assert fn.stats.captures == 1 and not fn.breaks


@pytest.mark.inductor
def test_while_loop_and_cond_inductor():
    _differential(Loop, "inductor", False, [(torch.randn(3, 4), torch.tensor(n)) for n in (3, 1)])
    _differential(Branch, "inductor", True, [(torch.randn(3, 4).abs() * s,) for s in (1, -1)])


def test_failure_of_stampouts_backend_runs_eagerly(monkeypatch, caplog):
    from stampout.backends import aot_eager

    def fails(*args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'shape_env'")

    monkeypatch.setattr(aot_eager, "aot_module_simplified", fails)
    fn = _differential(Branch, "aot_eager", True, [(torch.randn(3, 4),), (-torch.randn(3, 4).abs(),)])
    assert "backend stampout.backends.aot_eager failed on its graph: AttributeError" in caplog.text
    assert fn.breaks and fn.breaks[0].module_type == "Branch"


def test_failure_of_stampouts_backend_with_fullgraph_raises(monkeypatch):
    from stampout.backends import aot_eager

    def fails(*args, **kwargs):
        raise AttributeError("no shape_env")

    monkeypatch.setattr(aot_eager, "aot_module_simplified", fails)
    fn = stampout.compile(Branch(), backend="aot_eager", fullgraph=True)
    with pytest.raises(stampout.BackendError, match="no shape_env"):
        fn(torch.randn(3, 4))
