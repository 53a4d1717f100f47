"""The model zoo: small, plain ``torch.nn`` models used by the demo, the benchmarks and the tests.

Every constructor is deterministic given ``seed`` and leaves the global RNG untouched.
Nothing here imports ``stampout`` unless a region variant is asked for
(``LlamaLike(config, regions=True)``), so the plain models have no stampout dependency at all.

    from stampout.tools.models import make_model, make_input
    model = make_model("llama", layers=8)
    (ids,) = make_input("llama", batch=2, seq=8)
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .llama import (
    DecoderLayer,
    LlamaAttention,
    LlamaConfig,
    LlamaLike,
    LlamaMLP,
    NestedDecoderLayer,
    RMSNorm,
    region_decoder_layer_cls,
)
from .seeding import seeded

__all__ = [
    "MLP",
    "MODEL_NAMES",
    "ConvNet",
    "DecoderLayer",
    "GPT2Block",
    "GPT2Like",
    "LlamaAttention",
    "LlamaConfig",
    "LlamaLike",
    "LlamaMLP",
    "NestedDecoderLayer",
    "RMSNorm",
    "make_input",
    "make_model",
    "region_decoder_layer_cls",
    "transformer_encoder",
]


# --------------------------------------------------------------------------------------------- MLP


class MLP(nn.Module):
    """``depth`` Linear layers (d -> hidden -> ... -> hidden -> d) with ReLU in between. Input [N, d]."""

    def __init__(self, d: int = 32, hidden: int = 64, depth: int = 3, seed: int | None = 0):
        super().__init__()
        if depth < 1:
            raise ValueError("depth must be >= 1")
        with seeded(seed):
            dims = [d] + [hidden] * (depth - 1) + [d]
            self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.d = d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


# ----------------------------------------------------------------------------------------- ConvNet


class ConvNet(nn.Module):
    """conv-BN-ReLU-maxpool, conv-BN-ReLU-avgpool, linear head. Input [N, 3, 16, 16] -> [N, classes]."""

    def __init__(self, classes: int = 10, seed: int | None = 0):
        super().__init__()
        with seeded(seed):
            self.conv1 = nn.Conv2d(3, 8, kernel_size=3, padding=1)
            self.bn1 = nn.BatchNorm2d(8)
            self.conv2 = nn.Conv2d(8, 16, kernel_size=3, padding=1)
            self.bn2 = nn.BatchNorm2d(16)
            self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)  # [N, 8, 8, 8]
        x = F.relu(self.bn2(self.conv2(x)))  # [N, 16, 8, 8]
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)  # [N, 16]
        return self.head(x)


# -------------------------------------------------------------------------------------------- GPT2


class GPT2Attention(nn.Module):
    def __init__(self, d: int, heads: int, ctx: int):
        super().__init__()
        self.heads = heads
        self.head_dim = d // heads
        self.c_attn = nn.Linear(d, 3 * d)  # fused qkv
        self.c_proj = nn.Linear(d, d)
        self.register_buffer("bias", torch.tril(torch.ones(ctx, ctx, dtype=torch.bool)).view(1, 1, ctx, ctx))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.heads, self.head_dim).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        mask = self.bias[:, :, :T, :T]
        att = att.masked_fill(~mask, torch.finfo(att.dtype).min)
        att = F.softmax(att, dim=-1)
        out = torch.matmul(att, v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(out)


class GPT2MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4, ctx: int = 32):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = GPT2Attention(d, heads, ctx)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = GPT2MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT2Like(nn.Module):
    """Learned positions + ``n_layer`` GPT-2 blocks + final LayerNorm. Input float [B, T, d], T <= ctx."""

    def __init__(self, n_layer: int = 2, d: int = 64, heads: int = 4, ctx: int = 32, seed: int | None = 0):
        super().__init__()
        self.d = d
        self.ctx = ctx
        with seeded(seed):
            self.wpe = nn.Embedding(ctx, d)
            self.h = nn.ModuleList(GPT2Block(d, heads, ctx) for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        pos = torch.arange(T, device=x.device)
        x = x + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


# ------------------------------------------------------------------------------ TransformerEncoder


def transformer_encoder(seed: int | None = 0) -> nn.TransformerEncoder:
    """``nn.TransformerEncoder``: 2 layers, d_model=32, nhead=4, batch_first, no dropout. Input [B, T, 32]."""
    with seeded(seed):
        layer = nn.TransformerEncoderLayer(
            d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True
        )
        return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


# ---------------------------------------------------------------------------------------- registry

MODEL_NAMES = ("mlp", "convnet", "llama", "gpt2", "encoder")


def make_model(name: str, seed: int | None = 0, **kwargs: Any) -> nn.Module:
    """Build a zoo model by name. Extra kwargs go to the constructor; for ``"llama"`` they may be
    ``LlamaConfig`` fields (``layers=8``) plus ``regions=``."""
    if name == "mlp":
        return MLP(seed=seed, **kwargs)
    if name == "convnet":
        return ConvNet(seed=seed, **kwargs)
    if name == "llama":
        regions = kwargs.pop("regions", False)
        config = kwargs.pop("config", None) or LlamaConfig(**kwargs)
        return LlamaLike(config, regions=regions, seed=seed)
    if name == "gpt2":
        return GPT2Like(seed=seed, **kwargs)
    if name == "encoder":
        if kwargs:
            raise TypeError(f"transformer_encoder takes no options, got {sorted(kwargs)}")
        return transformer_encoder(seed=seed)
    raise KeyError(f"unknown model {name!r}; known: {MODEL_NAMES}")


def make_input(
    name: str,
    batch: int = 2,
    seq: int = 8,
    seed: int = 0,
    requires_grad: bool = False,
    model: nn.Module | None = None,
) -> tuple[torch.Tensor, ...]:
    """Positional inputs (a tuple) for zoo model ``name``. ``model`` (optional) supplies sizes
    (vocab, d) when it was built with non-default ones. ``requires_grad`` applies to float inputs."""
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        d = model.d if model is not None else 32
        x = torch.randn(batch, d, generator=g)
    elif name == "convnet":
        x = torch.randn(batch, 3, 16, 16, generator=g)
    elif name == "llama":
        vocab = model.config.vocab if model is not None else LlamaConfig().vocab
        return (torch.randint(0, vocab, (batch, seq), generator=g),)
    elif name == "gpt2":
        d = model.d if model is not None else 64
        x = torch.randn(batch, seq, d, generator=g)
    elif name == "encoder":
        x = torch.randn(batch, seq, 32, generator=g)
    else:
        raise KeyError(f"unknown model {name!r}; known: {MODEL_NAMES}")
    if requires_grad:
        x.requires_grad_(True)
    return (x,)
