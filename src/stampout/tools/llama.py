"""The zoo's Llama-like decoder: config, RMSNorm, rotary embedding, grouped-query attention, decoder layers
(plain, a `stampout.region`, or a Dynamo nested compile region) and `LlamaLike`. Re-exported by `tools.models`."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .seeding import seeded


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
        with seeded(seed):
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
