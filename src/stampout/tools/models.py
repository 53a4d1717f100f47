"""The model zoo: small, plain ``torch.nn`` models used by the demo, the benchmarks and the tests.

Every constructor is deterministic given ``seed`` and leaves the global RNG untouched.
Nothing here imports ``stampout`` unless a region variant is asked for
(``LlamaLike(config, regions=True)``), so the plain models have no stampout dependency at all.

    from stampout.tools.models import make_model, make_input
    model = make_model("llama", layers=8)
    (ids,) = make_input("llama", batch=2, seq=8)
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

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


@contextlib.contextmanager
def _seeded(seed: int | None):
    """Run the body under ``torch.manual_seed(seed)`` without disturbing the caller's RNG state."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# --------------------------------------------------------------------------------------------- MLP


class MLP(nn.Module):
    """``depth`` Linear layers (d -> hidden -> ... -> hidden -> d) with ReLU in between. Input [N, d]."""

    def __init__(self, d: int = 32, hidden: int = 64, depth: int = 3, seed: int | None = 0):
        super().__init__()
        if depth < 1:
            raise ValueError("depth must be >= 1")
        with _seeded(seed):
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
        with _seeded(seed):
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


# ------------------------------------------------------------------------------------------- Llama


@dataclasses.dataclass
class LlamaConfig:
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    layers: int = 4
    vocab: int = 128
    eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    # q, k: [B, H, T, D]; cos, sin: [T, D]
    cos = cos[None, None]
    sin = sin[None, None]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int, device: torch.device, dtype: torch.dtype):
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.heads = config.heads
        self.kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden, config.heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden, config.kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden, config.kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.heads * config.head_dim, config.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        n_rep = self.heads // self.kv_heads
        if n_rep > 1:  # grouped-query attention: expand kv heads
            k = k[:, :, None].expand(B, self.kv_heads, n_rep, T, self.head_dim)
            k = k.reshape(B, self.heads, T, self.head_dim)
            v = torch.repeat_interleave(v, n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden, config.intermediate, bias=False)
        self.up_proj = nn.Linear(config.hidden, config.intermediate, bias=False)
        self.down_proj = nn.Linear(config.intermediate, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Llama decoder layer. ``forward(hidden, cos, sin) -> hidden`` (one tensor out)."""

    def __init__(self, config: LlamaConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden, config.eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden, config.eps)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin)
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden


class NestedDecoderLayer(DecoderLayer):
    """The decoder layer marked for Dynamo with ``torch.compiler.nested_compile_region``."""

    forward = torch.compiler.nested_compile_region(DecoderLayer.forward)


_REGION_LAYER_CLS: type | None = None


def region_decoder_layer_cls() -> type:
    """``DecoderLayer`` subclass whose ``forward`` is a ``stampout.region`` (stampout imported lazily)."""
    global _REGION_LAYER_CLS
    if _REGION_LAYER_CLS is None:
        import stampout

        class RegionDecoderLayer(DecoderLayer):
            forward = stampout.region(DecoderLayer.forward)

        RegionDecoderLayer.__module__ = __name__
        RegionDecoderLayer.__qualname__ = "RegionDecoderLayer"
        _REGION_LAYER_CLS = RegionDecoderLayer
    return _REGION_LAYER_CLS


class LlamaLike(nn.Module):
    """Tiny Llama: embedding, ``config.layers`` decoder layers, final RMSNorm, lm head.

    Input: LongTensor token ids [B, T]; output: logits [B, T, vocab].

    ``regions``: ``False`` (plain ``DecoderLayer``), ``True`` (forward is a ``stampout.region``) or
    ``"nested"`` (forward marked with ``torch.compiler.nested_compile_region``, for Dynamo).
    """

    def __init__(self, config: LlamaConfig | None = None, regions: bool | str = False, seed: int | None = 0):
        super().__init__()
        config = config if config is not None else LlamaConfig()
        self.config = config
        if regions is True or regions == "stampout":
            layer_cls = region_decoder_layer_cls()
        elif regions == "nested":
            layer_cls = NestedDecoderLayer
        elif regions is False or regions is None:
            layer_cls = DecoderLayer
        else:
            raise ValueError(f"regions must be False, True or 'nested', not {regions!r}")
        with _seeded(seed):
            self.embed_tokens = nn.Embedding(config.vocab, config.hidden)
            self.layers = nn.ModuleList(layer_cls(config, i) for i in range(config.layers))
            self.norm = RMSNorm(config.hidden, config.eps)
            self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
            self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(input_ids.shape[1], hidden.device, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.lm_head(self.norm(hidden))


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
        with _seeded(seed):
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
    with _seeded(seed):
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
