"""Tensor state that is no metadata, read in forward (a parameter's `.grad`, an input's `._version`), is never
baked into a graph: the program runs eagerly with a warning that names why, or a region reading it is traced
per call."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import stampout

D = 4


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, D, generator=torch.Generator().manual_seed(seed))


class ReadsGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.lin.weight.grad
        h = self.lin(x)
        return h if g is None else h + g.sum(0)


class ReadsVersion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (2.0 if x._version > 0 else 1.0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_gradient_read_in_forward_is_not_baked(backend, caplog):
    torch.manual_seed(0)
    model = ReadsGrad()
    fn = stampout.compile(copy.deepcopy(model), backend=backend)
    with caplog.at_level(logging.WARNING, logger="stampout"):
        x = _x()
        torch.testing.assert_close(fn(x), model(x))
        for m in (model, fn._orig_mod):
            m.lin.weight.grad = torch.ones(D, D)
        torch.testing.assert_close(fn(x), model(x))
    assert any(".grad" in r.getMessage() for r in caplog.records)


def test_a_version_read_in_forward_is_not_baked():
    torch.manual_seed(0)
    model = ReadsVersion()
    fn = stampout.compile(copy.deepcopy(model), backend="eager")
    torch.testing.assert_close(fn(_x()), model(_x()))
    x, y = _x(), _x()
    x.add_(0)
    y.add_(0)
    torch.testing.assert_close(fn(x), model(y))


def test_a_region_reading_grad_is_traced_per_call():
    class Block(ReadsGrad):
        pass

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    model[1].lin.weight.grad = torch.ones(D, D)
    with stampout.auto_regions(model):
        cap = stampout.capture(model, _x())
    assert cap.stats.reuses == 0
    torch.testing.assert_close(cap(_x()), model(_x()))


def _tags_its_output(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    y.tag = "scaled"  # (a Python attribute on a tensor the program computed and returns)
    return y


def test_attributes_set_on_an_output_tensor_are_refused_by_capture_and_kept_by_compile():
    # (each call of a captured graph returns a new tensor: the attribute was silently missing)
    with pytest.raises(stampout.CaptureError, match=r"Python attributes on an output tensor \(\.tag\)"):
        stampout.capture(_tags_its_output, torch.ones(3))
    fn = stampout.compile(_tags_its_output, backend="aot_eager")
    for _ in range(2):
        out = fn(torch.ones(3))
        assert out.tag == "scaled"
        torch.testing.assert_close(out, torch.full((3,), 2.0))


class TagsItsOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y.gain = 2.0
        return y


class ReadsTheTag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([TagsItsOutput() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            x = x * getattr(x, "gain", 1.0)
        return x


def test_a_region_that_tags_its_output_is_not_stamped():
    # (a stamped call's output is a new tensor without the tag: the caller's Python took the other branch)
    torch.manual_seed(0)
    model, x = ReadsTheTag(), torch.randn(2, 3)
    cap = stampout.capture(model, x)
    assert cap.stats.reuses == 0
    torch.testing.assert_close(cap(x), model(x))


class ScalesByItsInputsTag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * x.scale


class TagsEachLayersInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ScalesByItsInputsTag() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = x * 1
            x.scale = float(i + 1)
            x = layer(x)
        return x


@pytest.mark.parametrize("how", ["capture", "compile"])
def test_a_region_reading_its_input_tensors_tag_is_guarded_by_the_tags_value(how):
    # (the fingerprint held the tag's name only: the later layers were stamped with the first one's scale)
    torch.manual_seed(0)
    model, x = TagsEachLayersInput(), torch.randn(2, 3)
    if how == "capture":
        cap = stampout.capture(model, x)
        assert cap.stats.traces == 3
        torch.testing.assert_close(cap(x), model(x))
    else:
        fn = stampout.compile(model, backend="aot_eager")
        for _ in range(2):
            torch.testing.assert_close(fn(x), model(x))


class CountsOnItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        self.register_buffer("b", torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.w.calls = getattr(self.w, "calls", 0) + 1  # (a Python attribute on a parameter, set in forward)
        self.b.seen = getattr(self.b, "seen", 0) + 2
        return x * self.w * self.w.calls + self.b.seen


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_attributes_set_on_a_parameter_in_forward_count_every_compiled_call(backend):
    # (a tensor's __dict__ is no watched state: compiled calls skipped the store and kept the first call's count)
    model, ref = CountsOnItsWeight(), CountsOnItsWeight()
    fn = stampout.compile(model, backend=backend)
    for _ in range(4):
        torch.testing.assert_close(fn(torch.ones(2)), ref(torch.ones(2)))
        assert (model.w.calls, model.b.seen) == (ref.w.calls, ref.b.seen)
