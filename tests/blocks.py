"""Small models and inputs shared by the behaviour files (test_per_layer_state.py, test_state_between_calls.py, ...):
`Block` is a residual block whose forward is the region, `stack_of(Block, n)` a seeded stack of them, `sample()`
a seeded input of width `D`; `Layer` (its region twin `Marked`) a layer reading a
config object `Cfg` it holds (`OtherCfg` another class of config); `RegionStack` runs given layers in turn, each
one's forward marked a region per instance (as transformers' layers are)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import stampout

D = 4


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class NormGelu(nn.Module):
    """A width-8 residual region (LayerNorm, Linear, GELU), for the Inductor files."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(8), nn.Linear(8, 8)

    @stampout.region
    def forward(self, x):
        return x + nn.functional.gelu(self.lin(self.norm(x)))


class Block(nn.Module):
    """A residual block whose forward is the region."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp()

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mlp(x))


class RegionStack(nn.Module):
    """`layers` in a ModuleList, each one's forward marked a region on the instance, run one after the other."""

    def __init__(self, layers: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        for layer in self.layers:
            layer.forward = stampout.region(layer.forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def stack_of(cls: type[nn.Module], n: int, *a: Any) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[cls(*a) for _ in range(n)])


def sample(*shape: int, grad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(*(shape or (2, D)), generator=g).requires_grad_(grad)


class Cfg:
    eps = 0.0


class OtherCfg(Cfg):
    eps = 5.0


class Layer(nn.Module):
    def __init__(self, cfg: Cfg) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.tanh(self.lin(x)) + self.cfg.eps


class Marked(Layer):
    forward = stampout.region(Layer.forward)
