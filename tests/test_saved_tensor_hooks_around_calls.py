"""Saved-tensor hooks the caller holds around a compiled call (a `checkpoint` whose body calls compiled
children, `saved_tensors_hooks`) see the tensors autograd saves when the graph runs, never the capture's fakes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import checkpoint

import stampout


class Checkpointed(nn.Module):
    """A forward that checkpoints a body calling two children (`compile` runs the forward eagerly: checkpoint
    saves the RNG state; the children are compiled pieces, captured inside checkpoint's hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda y: self.b(torch.relu(self.a(y))), x, use_reentrant=False)


def _grads(model: nn.Module, fn, x: torch.Tensor) -> list[torch.Tensor]:
    fn(x).pow(2).sum().backward()
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_checkpoint_around_compiled_children_backward_matches_eager(backend: str) -> None:
    torch.manual_seed(0)
    model = Checkpointed()
    twin = copy.deepcopy(model)
    compiled = stampout.compile(twin, backend=backend)
    for step in range(3):  # the first call captures the children inside checkpoint's forward
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        expected = _grads(model, model, x)
        got = _grads(twin, compiled, x)
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_callers_pack_hook_never_sees_a_fake(backend: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    twin = copy.deepcopy(model)
    compiled = stampout.compile(twin, backend=backend)
    seen: list[type] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(type(t))
        return t

    x = torch.randn(3, 4)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = _grads(twin, compiled, x)
    assert seen and not any(issubclass(cls, FakeTensor) for cls in seen), seen
    for e, g in zip(_grads(model, model, x), got, strict=True):
        torch.testing.assert_close(g, e)


class ReentrantCheckpoint(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.lin, x, use_reentrant=True)  # (reads the parameters unpassed)


def test_reentrant_checkpointing_is_refused_by_capture_and_run_eagerly_by_compile():
    """(Was: torch's raw AssertionError from the fake mode under stampout.capture.)"""
    torch.manual_seed(0)
    model = ReentrantCheckpoint()
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(stampout.CaptureError, match="CheckpointFunction") as caught:
        stampout.capture(model, x)
    assert "test_saved_tensor_hooks_around_calls.py" in str(caught.value)
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="aot_eager")
    for _ in range(2):
        x = torch.randn(2, 4, requires_grad=True)
        out, expected = fn(x), reference(x)
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(model.lin.weight.grad, reference.lin.weight.grad)
