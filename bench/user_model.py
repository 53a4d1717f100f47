"""A plain Llama-style decoder defined in a user file (not in stampout's zoo): what the benchmarks call the
"user" model. User code is guarded the way a user's model is (globals, closures, class attributes)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256
EPS = 1e-6


class Norm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def rotate(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).transpose(1, 3).unbind(2)
        q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class Layer(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = Norm(d), Norm(d)
        self.attn = Attention(d, heads)
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.gate = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class StampoutLayer(Layer):
    pass


class NestedLayer(Layer):
    pass


def _marked_classes() -> None:
    import stampout

    StampoutLayer.forward = stampout.region(Layer.forward)
    NestedLayer.forward = torch.compiler.nested_compile_region(Layer.forward)


class Decoder(nn.Module):
    def __init__(self, layers: int, d: int = 64, heads: int = 4, regions: bool | str = False) -> None:
        super().__init__()
        if regions and Layer.forward is StampoutLayer.forward:
            _marked_classes()
        cls = {True: StampoutLayer, "nested": NestedLayer}.get(regions, Layer)
        self.embed = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(cls(d, heads) for _ in range(layers))
        self.norm = Norm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        half = d // heads // 2
        inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.scale = 1 / math.sqrt(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(ids.shape[1], dtype=torch.float32)[:, None] * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))
