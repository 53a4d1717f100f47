"""The user's global module hooks (`register_module_forward_hook`) run on the user's modules only, as in eager, under
every backend and with regions; a Capture's graph runs without them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import stampout

D = 4


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, D, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def halving_hook():
    seen: list[str] = []

    def hook(module, args, out):
        seen.append(type(module).__name__)
        return out * 0.5

    handle = nn.modules.module.register_module_forward_hook(hook)
    yield seen
    handle.remove()


@pytest.mark.parametrize(("backend", "regions"), [("eager", None), ("eager", "auto"), ("aot_eager", None)])
def test_a_global_forward_hook_runs_on_the_users_modules_only(backend, regions, halving_hook):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D))
    fn = stampout.compile(copy.deepcopy(model), backend=backend, regions=regions)
    for seed in range(2):
        halving_hook.clear()
        expected = model(_x(seed))
        eager_seen = list(halving_hook)
        halving_hook.clear()
        torch.testing.assert_close(fn(_x(seed)), expected)
        assert sorted(set(halving_hook)) == sorted(set(eager_seen))


def test_a_capture_runs_without_global_hooks_on_its_graph(halving_hook):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D))
    cap = stampout.capture(model, _x())
    torch.testing.assert_close(cap(_x()), model(_x()))


class RegistersItsHook(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin.register_forward_hook(lambda module, args, out: out * 2)  # (one more each call: eager's bug, kept)
        return self.lin(x)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_hook_registered_in_forward_each_call_runs_eagerly(backend):
    # (hook dicts are no watched state: the second call passed the guard on the hooks the first call left and ran
    # the graph traced with one hook, where eager has two)
    torch.manual_seed(0)
    model, x = RegistersItsHook(), torch.randn(2, 4)
    ref = copy.deepcopy(model)
    fn = stampout.compile(model, backend=backend)
    for _ in range(3):
        torch.testing.assert_close(fn(x), ref(x))
    assert len(model.lin._forward_hooks) == len(ref.lin._forward_hooks) == 3
