"""What a region's fingerprint must include: torch's global switches, the memory layouts kernels produce (channels
last), in-place activations after ops that need grad, nested regions that differ. Each equals eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import TORCH_214_FAKE_GROUP_NORM, assert_matches_eager
from torch import nn

import stampout


class InplaceBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.hardtanh(self.act(self.fc(x) * 2) * 1.5, -1.0, 1.0, True)


def test_inplace_activations_after_ops_that_need_grad():
    model = nn.Sequential(InplaceBlock(), InplaceBlock(), InplaceBlock())
    cap = assert_matches_eager(model, torch.randn(2, 8), grad=True)
    assert (cap.stats.traces, cap.stats.reuses) == (1, 2)
    fn = stampout.compile(model, backend="aot_eager")
    x = torch.randn(2, 8, requires_grad=True)
    torch.testing.assert_close(fn(x), model(x))


class FlagReader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 5.0 if torch.are_deterministic_algorithms_enabled() else 1.0
        return self.lin(x) * (3.0 if torch.backends.mkldnn.enabled else 1.0) * scale


@pytest.fixture
def restore_flags():
    mkldnn, deterministic = torch.backends.mkldnn.enabled, torch.are_deterministic_algorithms_enabled()
    yield
    torch.backends.mkldnn.enabled = mkldnn
    torch.use_deterministic_algorithms(deterministic)


def test_torch_global_switches_are_part_of_every_fingerprint(restore_flags):
    model = nn.Sequential(FlagReader(), FlagReader())
    x = torch.randn(2, 4)
    fn = stampout.compile(model, backend="eager")
    torch.testing.assert_close(fn(x), model(x))
    torch.backends.mkldnn.enabled = False
    torch.testing.assert_close(fn(x), model(x))
    assert fn.stats.captures == 2

    def flips(x: torch.Tensor) -> torch.Tensor:  # the switch changes between two region calls of one capture
        h = model[0](x)
        torch.use_deterministic_algorithms(True)
        return model[1](h)

    cap = stampout.capture(flips, x)
    assert cap.stats.traces == 2
    torch.use_deterministic_algorithms(False)
    expected = flips(x)
    torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(cap(x), expected)


@pytest.mark.parametrize("layer", [
    pytest.param(nn.Conv2d(3, 3, 3, padding=1), id="conv"),
    pytest.param(nn.ConvTranspose2d(3, 3, 3, padding=1), id="conv_transpose"),
    pytest.param(nn.GroupNorm(1, 3), id="group_norm", marks=TORCH_214_FAKE_GROUP_NORM)])
def test_channels_last_layouts_as_the_kernels_produce_them(layer: nn.Module):
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.layer(x)
            return y * (2.0 if y.is_contiguous() else 1.0)

    model = Branchy()
    x = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    torch.testing.assert_close(stampout.capture(model, x)(x), model(x))
    torch.testing.assert_close(stampout.compile(model, backend="eager")(x), model(x))


class Inner(nn.Module):
    def __init__(self, a: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.a = a

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.a


class Outer(nn.Module):
    def __init__(self, a: float) -> None:
        super().__init__()
        self.inner = nn.ModuleList([Inner(1.0), Inner(a)])

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.inner:
            x = layer(x)
        return x


def test_nested_regions_that_differ_compile():
    torch.manual_seed(0)
    model = nn.Sequential(Outer(1.0), Outer(2.0), Outer(1.0))
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager")
    x = torch.randn(2, 8)
    torch.testing.assert_close(fn(x), reference(x))
    torch.testing.assert_close(fn(x * 2), reference(x * 2))
    assert fn.stats.captures == 1
