"""Backends x (inference, training) x (flat, regions) against eager values and gradients.

Inductor compiles are slow on 2 cores: those cases are few, small and marked `inductor`.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import named_grads
from torch import nn

import stampout
from stampout.backends import inductor as inductor_backend


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class RegionBlock(Block):
    forward = stampout.region(Block.forward)


class Net(nn.Module):
    def __init__(self, block=Block, n=3, d=16):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList([block(d) for _ in range(n)])

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


def check_backend(backend, block, train: bool, n: int = 3, rtol=1e-4, atol=1e-5):
    torch.manual_seed(0)
    model = Net(block, n)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 16)
    fn = stampout.compile(model, backend=backend)
    with torch.set_grad_enabled(train):
        out, expected = fn(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    if train:
        out.pow(2).mean().backward()
        expected.pow(2).mean().backward()
        got, want = named_grads(model), named_grads(reference)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol,
                                       msg=lambda m, name=name: f"grad of {name}: {m}")
    else:
        assert not out.requires_grad
    return fn


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("block", [Block, RegionBlock], ids=["flat", "regions"])
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_backend_matches_eager(backend, block, train):
    fn = check_backend(backend, block, train)
    assert fn.stats.captures == 1
    assert fn.stats.traces == (1 if block is RegionBlock else 0)


def test_custom_backend_callable_gets_the_graph_and_example_inputs():
    seen = {}

    def backend(gm, example_inputs):
        seen["gm"], seen["inputs"] = gm, example_inputs
        return gm

    fn = check_backend(backend, Block, train=False)
    assert isinstance(seen["gm"], torch.fx.GraphModule)
    assert all(isinstance(t, torch.Tensor) for t in seen["inputs"])
    assert fn.last_capture.gm is seen["gm"]


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(stampout.BackendError, match="unknown backend 'tvm'"):
        stampout.compile(Net(), backend="tvm")


def test_eager_backward_through_region_calls_works():
    """Plain eager backward through invoke_subgraph fails on torch 2.13; stampout's eager path must not."""
    check_backend("eager", RegionBlock, train=True)


@pytest.mark.inductor
def test_inductor_flat_and_regions_inference():
    check_backend("inductor", Block, train=False, n=2)
    fn = check_backend("inductor", RegionBlock, train=False, n=2)
    assert fn.stats.traces == 1


@pytest.mark.inductor
def test_inductor_training_on_reused_regions_gives_eager_gradients():
    """Regression test for torch 2.13's wrong gradients through reused subgraphs (TORCH_NOTES.md).

    On this llama-like stack, Inductor without stampout's workaround returns gradients 36 % off on
    layers.1.input_layernorm.weight; with it they match eager. Fails if the workaround is removed.
    """
    from stampout.tools.models import LlamaConfig, LlamaLike

    assert inductor_backend.AVOID_REUSED_SUBGRAPH_BUFFER_BUG
    torch.manual_seed(0)
    model = LlamaLike(LlamaConfig(layers=2), regions=True)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16))
    fn = stampout.compile(model, backend="inductor")
    out, expected = fn(ids), reference(ids)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    out.float().pow(2).mean().backward()
    expected.float().pow(2).mean().backward()
    got, want = named_grads(model), named_grads(reference)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-5,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")
    assert fn.stats.traces == 1


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_region_called_with_and_without_grad(backend):
    """A region traced under no_grad must not share its subgraph name with grad-mode calls (AOTAutograd
    keys subgraph traces by name; sharing one crashed its backward)."""
    @stampout.region
    def block(x, w):
        return (x @ w).sin()

    w = torch.randn(8, 8, requires_grad=True)

    def prog(x):
        with torch.no_grad():
            a = block(x, w)
        return block(a, w)

    x = torch.randn(4, 8)
    fn = stampout.compile(prog, backend=backend)
    out = fn(x)
    out.sum().backward()
    expected_grad = torch.autograd.grad(prog(x).sum(), w)[0]
    torch.testing.assert_close(w.grad, expected_grad)
    assert [e.outcome for e in fn.last_capture.events] == ["traced", "traced"]


def test_backend_failure_is_a_stampout_error():
    def broken(gm, example_inputs):
        raise ValueError("no kernels today")

    with pytest.raises(stampout.BackendError, match="no kernels today"):
        stampout.compile(Net(), backend=broken)(torch.randn(4, 16))
