"""Red-team round (redteam2): a rotary-embedding style cache that grows (`if n > self.max_n: self.register_buffer("c",
..)`, old transformers' LlamaRotaryEmbedding) in repeated layers under `regions="auto"`. When the whole-program
capture fails for the new size (symbolic, then static: "a tensor made by no torch call the capture sees"), the
per-layer captures of the piecewise fallback leave FakeTensors in each layer's `_buffers` (registered by torch's own
`register_buffer`, a store no watch sees): the next call raises torch's "Please convert all Tensors to FakeTensors"
(loud, but user state holds fakes, against SPEC §3; watch/world_snapshot.py's repair does not undo it, and only
STAMPOUT_CHECK_WORLD's check finds it). Fixed (soundness3): a capture notes the registries of modules a live entry
watches too (bumping dict subclasses, which `Registries` skipped), so the registration is undone and replayed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout


class Rot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._set(2)

    def _set(self, n: int) -> None:
        self.max_n = n
        self.register_buffer("c", torch.arange(n).float().cos(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_n:
            self._set(x.shape[0])
        return self.c[: x.shape[0]]


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rot = Rot()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.rot(x)[:, None]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_growing_registered_buffer_cache_keeps_real_tensors():
    torch.manual_seed(0)
    model = Model()
    reference = Model()
    reference.load_state_dict(model.state_dict())
    fn = stampout.compile(model, backend="eager", regions="auto")
    # (a user's default: with STAMPOUT_CHECK_WORLD, set for the suite, the leftover is found and that call runs
    # eagerly; without it the fakes stay)
    with torch.no_grad(), stampout.config.patch(check_world=False):
        for n in (2, 3, 4, 4, 5):
            x = torch.ones(n, 2)
            torch.testing.assert_close(fn(x), reference(x))
            assert all(type(layer.rot.c) is torch.Tensor for layer in model.layers)
