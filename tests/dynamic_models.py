"""Models and inputs shared by test_dynamic.py and test_dynamic_compile_modes.py: a stack of regions that split
into heads by the input's sizes, and an input marked dynamic."""

from __future__ import annotations

import torch
from torch import nn

import stampout

LENGTHS = (8, 12, 5, 16, 9, 24, 3, 31)


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.fc(self.norm(x)).view(b, t, 2, d // 2).transpose(1, 2).reshape(b, 2, t * (d // 2))
        return x + h.view(b, 2, t, d // 2).transpose(1, 2).reshape(b, t, d)


class Stack(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Size, int]:
        for layer in self.layers:
            x = layer(x)
        return x[:, : x.shape[1] // 2], x.shape, x.shape[1] * 2


def dynamic_input(t: int, dim: int = 1, batch: int = 2) -> torch.Tensor:
    x = torch.randn(batch, t, 16)
    torch._dynamo.mark_dynamic(x, dim)
    return x
