"""The inductor backend draws eager's random numbers: `dropout`, `rand_like`, `randn` in a compiled program give the
values eager gives for the same seed, and leave torch's generator as eager leaves it (what the caller draws after
the call is eager's too). Inductor's own generator, seeded from torch's once per call, would give others."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import stampout


def _noisy(x: torch.Tensor) -> torch.Tensor:
    return F.dropout(x, 0.5, training=True) + torch.rand_like(x) * torch.randn(8)


def test_inductor_draws_eagers_random_numbers() -> None:
    compiled = stampout.compile(_noisy, backend="inductor")
    x = torch.ones(8)
    for seed in (0, 1):
        torch.manual_seed(seed)
        expected, after = _noisy(x), torch.randn(3)
        torch.manual_seed(seed)
        out = compiled(x)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(torch.randn(3), after)  # (the generator advanced as in eager)
