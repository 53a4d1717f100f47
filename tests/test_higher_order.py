"""torch.cond and the other higher-order ops users write: captured as graph nodes with traced subgraphs."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_matches_eager, named_grads, tree_assert_close
from torch import nn
from torch._higher_order_ops.associative_scan import associative_scan
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop

import stampout

COND = torch.ops.higher_order.cond


class CondModel(nn.Module):
    """A data-dependent branch: a layer on one side, a closure-free op on the other."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(3.0))

    def forward(self, x):
        def true_fn(x):
            return self.lin(x).sin()

        def false_fn(x):
            return x.exp() * self.scale

        return torch.cond(x.sum() > 0, true_fn, false_fn, (x,)) + 1


def positive():
    return torch.rand(3, 4) + 0.1


def hop_nodes(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


@pytest.mark.parametrize("make", [positive, lambda: -positive()], ids=["true", "false"])
def test_cond_capture_matches_eager_both_branches(make):
    cap = assert_matches_eager(CondModel(), make().requires_grad_(), grad=True)
    (node,) = hop_nodes(cap.gm, COND)
    true_gm, false_gm = (getattr(cap.gm, a.target) for a in node.args[1:3])
    # the closure's parameters are lifted: both branches take x, lin.weight, lin.bias, scale
    assert len(node.args[3]) == 4
    for gm in (true_gm, false_gm):
        assert len([n for n in gm.graph.nodes if n.op == "placeholder"]) == 4


def test_one_capture_runs_both_branches():
    model = CondModel()
    cap = stampout.capture(model, positive())
    for x in (positive(), -positive()):
        torch.testing.assert_close(cap(x), model(x))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_cond_compiles_forward_and_backward(backend):
    model = CondModel()
    ref = copy.deepcopy(model)
    fn = stampout.compile(model, backend=backend)
    for x in (positive(), -positive(), positive()):
        out = fn(x.clone().requires_grad_())
        expected = ref(x.clone().requires_grad_())
        tree_assert_close(out, expected)
        out.sum().backward()
        expected.sum().backward()
        tree_assert_close(named_grads(model), named_grads(ref))
    assert fn.stats.captures == 1  # the predicate is data: one graph serves both branches


@pytest.mark.inductor
def test_cond_inductor():
    model = CondModel()
    fn = stampout.compile(model, backend="inductor")
    with torch.no_grad():
        for x in (positive(), -positive()):
            torch.testing.assert_close(fn(x), model(x))


def test_cond_nested_output_structure_and_symbolic_predicate():
    def f(x, y):
        def true_fn(x, y):
            return {"a": x + y, "b": (x * y,)}

        def false_fn(x, y):
            return {"a": x - y, "b": (x / y,)}

        return torch.cond(x.shape[0] > 2, true_fn, false_fn, (x, y))["b"][0] + torch.cond(
            (x * y).mean() > 0, true_fn, false_fn, (x, y))["a"]

    x, y = torch.randn(3, 4), torch.rand(3, 4) + 1
    cap = assert_matches_eager(f, x, y)
    assert len(hop_nodes(cap.gm, COND)) == 1  # a Python predicate (a static size) picks its branch
    torch.testing.assert_close(cap(-x, y), f(-x, y))


def test_cond_with_dynamic_sizes():
    model = CondModel()
    fn = stampout.compile(model, backend="aot_eager", dynamic=True)
    for n in (3, 5, 7):
        x = torch.rand(n, 4) - 0.5
        torch.testing.assert_close(fn(x), model(x))
    assert fn.stats.captures == 1


def test_cond_branches_that_disagree_raise_capture_error():
    def f(x):
        return torch.cond(x.sum() > 0, lambda x: x.sum(0), lambda x: x * 2, (x,))

    with pytest.raises(stampout.CaptureError, match="cond cannot be captured"):
        stampout.capture(f, torch.randn(3, 4))


def test_while_loop():
    def f(i, x):
        return while_loop(lambda i, x: i < 5, lambda i, x: (i + 1, x * 2 + 1), (i, x))

    i, x = torch.tensor(0), torch.randn(3)
    cap = assert_matches_eager(f, i, x)
    assert len(hop_nodes(cap.gm, torch.ops.higher_order.while_loop)) == 1
    tree_assert_close(cap(torch.tensor(3), x), f(torch.tensor(3), x))  # the trip count is data


def test_while_loop_reads_a_parameter():
    lin = nn.Linear(3, 3)

    def f(x):
        return while_loop(lambda x: x.abs().sum() < 100, lambda x: (lin(x) * 2 + 1,), (x,))

    assert_matches_eager(f, torch.randn(3))


def test_map_and_scans():
    w = torch.randn(4)

    def f(xs):
        mapped = torch._higher_order_ops.map(lambda x, w: x * w + 1, xs, w)
        carry, ys = scan(lambda c, x: (c + x, (c * x).sin()), torch.zeros(4), xs)
        cum = associative_scan(lambda a, b: a + b, xs, dim=0, combine_mode="generic")
        return mapped, carry, ys, cum

    xs = torch.randn(5, 4)
    cap = assert_matches_eager(f, xs)
    tree_assert_close(cap(xs * 3), f(xs * 3))


def test_cond_in_a_region_stamps_out():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.cond(x.mean() > 0, lambda x: self.lin(x), lambda x: -self.lin(x), (x,))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(stampout.region(Layer()) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    cap = assert_matches_eager(Net(), torch.randn(2, 4), grad=True)
    assert cap.stats.traces == 1
