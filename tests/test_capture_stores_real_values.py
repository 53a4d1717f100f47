"""What `stampout.capture` stores where the program kept a traced value is what one eager call stores (SPEC §3:
where eager would have stored a real value, the real value is stored or the capture refuses)."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch import nn

import stampout


class AuxLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.aux = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.aux = h.pow(2).mean()  # (a loss the training loop adds: it must keep its graph)
        return h


@pytest.mark.parametrize("grad", [True, False])
def test_a_loss_stored_on_the_module_keeps_its_autograd_graph(grad):
    torch.manual_seed(0)
    model, x = AuxLoss(), torch.randn(2, 4)
    with torch.set_grad_enabled(grad):
        model(x)
        expected = model.aux
        model.aux = None
        stampout.capture(model, x)
    got = model.aux
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, expected)
    assert got.requires_grad == expected.requires_grad == grad
    if grad:
        got.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        expected.backward()
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(g, p.grad)


@pytest.mark.parametrize("where", ["module", "global"])
@pytest.mark.parametrize("how", ["capture", "compile"])
def test_a_forward_hook_filling_a_closure_dict_leaves_real_activations(how, where):
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)
    acts: dict = {}

    def keep(mod, args, out):
        if isinstance(mod, nn.Linear):
            acts["lin"] = out

    handle = (model[0].register_forward_hook(keep) if where == "module"
              else nn.modules.module.register_module_forward_hook(keep))
    try:
        model(x)
        expected = acts.pop("lin")
        if how == "capture":
            stampout.capture(model, x)
        else:
            stampout.compile(model, backend="eager")(x)
    finally:
        handle.remove()
    assert type(acts["lin"]) is torch.Tensor
    torch.testing.assert_close(acts["lin"], expected)


class LazyNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self._noise = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._noise is None:  # (drawn once, then reused: a graph would draw it on every call)
            self._noise = torch.randn(4)
        return self.lin(x) + self._noise


def _lazy_noise_calls(fn, model, x):
    torch.manual_seed(1)
    model._noise = None
    return [fn(x), fn(x), fn(x), torch.randn(3)]  # (the stream after: drawn from once)


def test_compile_draws_a_lazily_memoized_random_tensor_once():
    torch.manual_seed(0)
    model, x = LazyNoise(), torch.randn(2, 4)
    expected = _lazy_noise_calls(model, model, x)
    for got, want in zip(_lazy_noise_calls(stampout.compile(model, backend="eager"), model, x), expected):
        torch.testing.assert_close(got, want)


def test_capture_refuses_a_lazily_memoized_random_tensor_and_leaves_eagers_value():
    torch.manual_seed(0)
    model, x = LazyNoise(), torch.randn(2, 4)
    torch.manual_seed(1)
    model(x)
    expected, after = model._noise, torch.randn(3)
    model._noise = None
    torch.manual_seed(1)
    with pytest.raises(stampout.StampoutError, match=r"drawn at random in LazyNoise\._noise"):
        stampout.capture(model, x)
    assert type(model._noise) is torch.Tensor
    torch.testing.assert_close(model._noise, expected)
    torch.testing.assert_close(torch.randn(3), after)


def test_a_module_made_in_the_call_draws_its_weights_on_every_call_as_eager():
    """Its weights are drawn in its __init__ and stored in its own registries, which do not outlive the call:
    no lazily memoized draw (the capture is not refused), and each call of the Capture draws them as eager does."""

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        @stampout.region
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    def fresh_layer(x: torch.Tensor) -> torch.Tensor:
        return Layer()(x)

    x = torch.randn(2, 4)
    cap = stampout.capture(fresh_layer, x)
    for seed in (3, 4):
        torch.manual_seed(seed)
        expected = fresh_layer(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(cap(x), expected)


RECENT: collections.deque = collections.deque(maxlen=3)


def _keeps_recent(x: torch.Tensor) -> torch.Tensor:
    h = x * 2
    RECENT.append(h)
    return h + 1


def test_a_traced_value_kept_in_a_global_deque_is_given_its_real_value():
    # (the real-value walk set dict and list items only: the deque kept the capture's FakeTensor)
    RECENT.clear()
    x = torch.randn(3)
    stampout.capture(_keeps_recent, x)
    assert len(RECENT) == 1 and type(RECENT[0]) is torch.Tensor
    torch.testing.assert_close(RECENT[0], x * 2)


@dataclasses.dataclass(frozen=True)
class _Frozen:
    t: torch.Tensor


KEPT: dict = {}


def _keeps_frozen(x: torch.Tensor) -> torch.Tensor:
    h = x * 2
    KEPT["last"] = _Frozen(h)
    return h + 1


def test_a_traced_value_in_a_frozen_dataclass_is_given_its_real_value():
    # (the real value was set with setattr, which a frozen dataclass refuses: the capture raised
    # FrozenInstanceError and left the FakeTensor there)
    KEPT.clear()
    x = torch.randn(3)
    stampout.capture(_keeps_frozen, x)
    assert type(KEPT["last"].t) is torch.Tensor
    torch.testing.assert_close(KEPT["last"].t, x * 2)
