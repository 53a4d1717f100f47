"""Fake strides equal real strides: every node's `meta['val']` against the tensor eager PyTorch computes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from helpers import TORCH_214_FAKE_GROUP_NORM
from torch import nn

import stampout
from stampout.backends.runner import as_call_modules


def stride_mismatches(cap, *args):
    """(node, real strides, fake strides) for each node whose real result is laid out otherwise than its fake."""
    found = []

    class Compare(fx.Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            fake = node.meta.get("val")
            if isinstance(out, torch.Tensor) and isinstance(fake, torch.Tensor) and out.stride() != fake.stride():
                found.append((node.name, out.stride(), fake.stride()))
            return out

    with torch.no_grad():
        Compare(as_call_modules(cap.gm)).run(*cap.placeholders_for(args, {}))
    return found


class Attention(nn.Module):
    """diffusers' VAE attention: heads split from a linear's output, so the query is a transposed view."""

    def __init__(self, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(64, 3 * 64)
        self.norm = nn.GroupNorm(16, 64)

    def forward(self, x):
        b, c, h, w = x.shape
        seq = x.view(b, c, h * w).transpose(1, 2)
        q, k, v = (t.view(b, h * w, self.heads, -1).transpose(1, 2) for t in self.qkv(seq).chunk(3, -1))
        out = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, h * w, c)
        return self.norm(out.transpose(1, 2).reshape(b, c, h, w) + x)


@pytest.mark.parametrize("heads", [1, 2])
def test_attention_strides_match(heads):
    torch.manual_seed(0)
    model = Attention(heads).eval()
    x = torch.randn(1, 64, 8, 8)
    cap = stampout.capture(model, x)
    assert stride_mismatches(cap, x) == []
    torch.testing.assert_close(cap(x), model(x))


@TORCH_214_FAKE_GROUP_NORM
def test_channels_last_convolution_strides_match():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
                          nn.Conv2d(16, 8, 1)).eval()
    x = torch.randn(2, 8, 6, 6).to(memory_format=torch.channels_last)
    cap = stampout.capture(model, x)
    assert stride_mismatches(cap, x) == []


@pytest.mark.slow
@pytest.mark.parametrize("regions", [None, "auto"])
def test_vae_compiles_with_aot_eager(regions):
    """diffusers' AutoencoderKL: fake and real layouts part after its attention block; aot_eager's group_norm
    must take the real tensor's (forward and backward), at two sizes."""
    pytest.importorskip("diffusers")
    from zoo_models import vae as build_vae

    vae = build_vae()
    reference = copy.deepcopy(vae)
    fn = stampout.compile(vae, backend="aot_eager", regions=regions)
    for size in (32, 16):
        x = torch.randn(1, 3, size, size)
        out, expected = fn(x).sample, reference(x).sample
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        out.square().mean().backward()
        expected.square().mean().backward()
        for (name, p), q in zip(vae.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        vae.zero_grad()
        reference.zero_grad()
    assert fn.breaks == []
