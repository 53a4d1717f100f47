"""More of torch.nn against eager: recurrent, convolutional, normalization, attention, parametrizations,
complex numbers, checkpointing, custom autograd functions. Values and (where trainable) gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_matches_eager
from torch import nn

import stampout


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        y, (h, c) = self.lstm(x)
        return self.head(y[:, -1]), h


class GRUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(8, 16, batch_first=True, bidirectional=True)

    def forward(self, x):
        return self.gru(x)[0]


class Conv1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv1d(4, 8, 3, padding=1)
        self.ct = nn.ConvTranspose1d(8, 4, 4, stride=2, padding=1)
        self.gn = nn.GroupNorm(2, 8)

    def forward(self, x):
        return self.ct(F.silu(self.gn(self.c(x))))


class UNetish(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.norm = nn.InstanceNorm2d(8, affine=True)
        self.up = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x):
        h = F.leaky_relu(self.norm(self.down(x)), 0.1)
        h = F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
        return torch.cat([h, x], 1).mean(1, keepdim=True) + self.up(h)


class Pixel(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 12, 3, padding=1)
        self.shuffle = nn.PixelShuffle(2)
        self.pool = nn.AdaptiveAvgPool2d(4)

    def forward(self, x):
        return self.pool(self.shuffle(self.c(x))).flatten(1)


class WeightNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.utils.parametrizations.weight_norm(nn.Linear(8, 8))

    def forward(self, x):
        return self.lin(x)


class Complex(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        z = torch.view_as_complex(self.lin(x).view(*x.shape[:-1], 4, 2))
        z = z * torch.polar(torch.ones(4), torch.arange(4.0))
        return torch.view_as_real(z).flatten(-2)


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(10, 8, padding_idx=0)
        self.bag = nn.EmbeddingBag(10, 8, mode="mean")

    def forward(self, i):
        return self.e(i).sum(1) + self.bag(i)


class MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=True)


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.Transformer(d_model=16, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                                dim_feedforward=32, dropout=0.0, batch_first=True)

    def forward(self, a, b):
        return self.t(a, b, tgt_mask=nn.Transformer.generate_square_subsequent_mask(b.shape[1]))


class Misc(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        y = self.bn(self.lin(x))
        y = y.clamp(-1, 1).new_zeros(y.shape) + y
        y = torch.where(y > 0, y, y * 0.1)
        z = y.softmax(-1).log1p().cumsum(-1).flip(-1).roll(1, -1)
        v, i = z.max(-1)
        t = z.topk(2, dim=-1).values
        return z.T.contiguous().mT, v, i, t.sort(-1).values, torch.einsum("bi,bj->bij", y, y).tril()


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 8)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(lambda h: self.l2(F.gelu(self.l1(h))), x, use_reentrant=False)


class ClampFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x > 0).float()


class UsesCustomFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return ClampFn.apply(self.lin(x))


cases = [
    ("lstm", LSTMNet(), (torch.randn(2, 5, 8),), True),
    ("gru", GRUNet(), (torch.randn(2, 5, 8),), True),
    ("conv1d", Conv1d(), (torch.randn(2, 4, 16),), True),
    ("unetish", UNetish(), (torch.randn(2, 3, 8, 8),), True),
    ("pixel", Pixel(), (torch.randn(2, 3, 8, 8),), True),
    ("weightnorm", WeightNorm(), (torch.randn(2, 8),), True),
    ("complex", Complex(), (torch.randn(2, 8),), True),
    ("embed", Embed(), (torch.randint(0, 10, (2, 5)),), True),
    ("mha", MHA(), (torch.randn(2, 5, 16),), True),
    ("transformer", Seq2Seq().eval(), (torch.randn(2, 5, 16), torch.randn(2, 4, 16)), True),
    ("misc-train", Misc().train(), (torch.randn(4, 8),), True),
    ("misc-eval", Misc().eval(), (torch.randn(4, 8),), False),
    ("checkpoint", Checkpointed(), (torch.randn(2, 8),), True),
    ("customfn", UsesCustomFunction(), (torch.randn(2, 8),), True),
]


@pytest.mark.parametrize("name, model, args, grad", cases, ids=[c[0] for c in cases])
def test_matches_eager(name, model, args, grad):
    torch.manual_seed(0)
    assert_matches_eager(model, *args, grad=grad)


def test_python_may_inspect_tensors_computed_from_constants_only():
    def fn(x):
        mask = torch.triu(torch.full((4, 4), float("-inf")), diagonal=1)
        if bool((mask == 0).any()):  # constant: fine to decide while tracing
            x = x + mask.sum(0).clamp(min=-1)
        return x * int(torch.arange(3).sum())

    cap = assert_matches_eager(fn, torch.randn(4))
    assert cap.stats.traces == 0


def test_constant_mixed_with_an_input_is_no_longer_constant():
    def fn(x):
        m = torch.zeros(4)
        m[:2] = x[:2]
        return x if bool(m.sum() > 0) else -x

    with pytest.raises(stampout.CaptureError, match="bool"):
        stampout.capture(fn, torch.randn(4))
