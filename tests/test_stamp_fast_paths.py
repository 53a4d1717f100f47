"""The cheap paths of a stamped call never serve another call's facts: a layer whose parameter differs from the traced
layer's in dtype, requires_grad or shape is traced again, and every lifted placeholder's `meta['val']` (and each stamped
call's output fake) has its own tensor's metadata; the fingerprint's memo of tensor attribute names keys on the names
themselves (an attribute set on an activation between layers makes the next call trace again)."""

from __future__ import annotations

import torch
from torch import nn

import stampout
from stampout.torch_internals import FakeTensor


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.lin(x)) * self.scale.to(x.dtype)


class Stack(nn.Module):
    def __init__(self, n: int = 4, tag_after: int | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(n))
        self.tag_after = tag_after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == self.tag_after:
                x.tag = "seen"  # (an attribute on the activation: part of the next call's fingerprint)
        return x


def _placeholder_meta(cap: stampout.Capture) -> dict[str, tuple]:
    assert cap.gm is not None  # (fills the deferred meta['val'] of lifted placeholders)
    return {n.name: (tuple(n.meta["val"].shape), n.meta["val"].dtype, n.meta["val"].requires_grad)
            for n in cap.gm.graph.nodes if n.op == "placeholder"}


def _check_placeholders(cap: stampout.Capture, model: nn.Module) -> None:
    meta = _placeholder_meta(cap)
    for name, p in model.named_parameters():
        assert meta[name.replace(".", "_")] == (tuple(p.shape), p.dtype, p.requires_grad), name


def test_a_parameter_with_another_dtype_requires_grad_or_shape_is_not_stamped_from_layer_0() -> None:
    for change in ("dtype", "requires_grad", "shape"):
        model = Stack()
        with torch.no_grad():
            if change == "dtype":
                model.layers[2].scale = nn.Parameter(torch.ones(4, dtype=torch.float64))
            elif change == "requires_grad":
                model.layers[2].scale.requires_grad_(False)
            else:
                model.layers[2].scale = nn.Parameter(torch.ones(1))  # (broadcasts: the same code runs)
        x = torch.randn(2, 4)
        cap = stampout.capture(model, x)
        outcomes = [e.outcome.value for e in cap.events]
        assert outcomes[2] != "reused" and outcomes.count("reused") == 2, (change, outcomes)
        _check_placeholders(cap, model)
        torch.testing.assert_close(cap(x), model(x))


def test_stamped_outputs_are_fakes_of_this_capture_with_the_traced_metadata() -> None:
    model = Stack(3)
    x = torch.randn(2, 4, requires_grad=True)
    cap = stampout.capture(model, x)
    assert (cap.stats.traces, cap.stats.reuses) == (1, 2)
    calls = [n for n in cap.gm.graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]
    modes = set()
    for call in calls:
        (out,) = call.meta["val"]
        assert isinstance(out, FakeTensor) and out.shape == (2, 4) and out.requires_grad
        modes.add(id(out.fake_mode))
    assert len(modes) == 1
    _check_placeholders(cap, model)
    torch.testing.assert_close(cap(x), model(x))
    x2 = x.detach().double()
    cap2 = stampout.capture(Stack(3).double(), x2)  # (another dtype: outputs are not the first capture's)
    assert all(n.meta["val"][0].dtype == torch.float64 for n in cap2.gm.graph.nodes
               if n.op == "call_function" and "invoke_subgraph" in str(n.target))


def test_an_attribute_set_on_an_activation_changes_the_fingerprint() -> None:
    model = Stack(4, tag_after=1)
    x = torch.randn(2, 4)
    cap = stampout.capture(model, x)
    # layer 2 gets a tagged activation (a new fingerprint), layer 3 an untagged one again (layer 0's entry)
    assert [e.outcome.value for e in cap.events] == ["traced", "reused", "deduped", "reused"]
    assert cap.events[2].reason.endswith(", tag")
    torch.testing.assert_close(cap(x), model(x))
