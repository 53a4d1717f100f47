"""What the cheap paths of a stamped or compiled call still see: a global module hook registered after the first
call (the fingerprint's global state) makes the next capture trace again and a compiled call capture again; the
stores a stamped call repeats land on its own objects, as real tensors, whether the objects were passed in or
reached through a closure (SPEC §3: no fake stays reachable from user state)."""

from __future__ import annotations

import torch
from torch import nn

import stampout


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Stack(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_global_forward_hook_registered_later_is_seen_by_a_compiled_call() -> None:
    model = Stack()
    x = torch.randn(2, 4)
    fn = stampout.compile(model, backend="eager", regions="auto")
    torch.testing.assert_close(fn(x), model(x))
    assert fn.stats.captures == 1
    seen: list[str] = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append(type(m).__name__))
    try:
        expected = model(x)
        eager_calls = list(seen)
        seen.clear()
        torch.testing.assert_close(fn(x), expected)
        assert fn.stats.captures > 1  # (the hooks are part of every call's key; stats count the pieces too)
        assert sorted(n for n in seen if n != "CompiledModule") == sorted(eager_calls)  # (the wrapper is a module)
    finally:
        handle.remove()
    seen.clear()
    fn(x)
    assert seen == []


def test_a_global_hook_between_captures_is_not_stamped_over() -> None:
    model = Stack()
    for layer in model.layers:
        layer.forward = stampout.region(layer.forward)
    x = torch.randn(2, 4)
    first = stampout.capture(model, x)
    assert (first.stats.traces, first.stats.reuses) == (1, 2)
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: out)
    try:
        cap = stampout.capture(model, x)
        assert cap.stats.traces == 1
        assert "global module hooks" in cap.events[0].reason or cap.events[0].reason == "first call"
        torch.testing.assert_close(cap(x), model(x))
    finally:
        handle.remove()


class Slot:
    def __init__(self) -> None:
        self.ready = False


class Writer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @stampout.region
    def forward(self, x: torch.Tensor, slot: Slot) -> torch.Tensor:
        slot.ready = True  # (a store each stamped call repeats on its own slot)
        slot.last = self.lin(x)
        return slot.last


def test_stamped_calls_repeat_their_stores_on_their_own_objects() -> None:
    model = nn.ModuleList(Writer() for _ in range(3))
    slots = [Slot() for _ in range(3)]

    def program(x: torch.Tensor) -> torch.Tensor:
        for layer, slot in zip(model, slots):
            x = layer(x, slot)
        return x

    x = torch.randn(2, 4)
    cap = stampout.capture(program, x)
    assert cap.stats.reuses == 2
    assert all(s.ready is True for s in slots)
    assert [type(s.last) for s in slots] == [torch.Tensor] * 3  # real values, as eager leaves them
    h = x
    for layer, slot in zip(model, slots):
        h = layer.lin(h)
        torch.testing.assert_close(slot.last, h)


def test_stamped_calls_store_on_objects_passed_in() -> None:
    model = nn.ModuleList(Writer() for _ in range(3))
    slots = [Slot() for _ in range(3)]

    def program(x: torch.Tensor, slots: list) -> torch.Tensor:
        for layer, slot in zip(model, slots):
            x = layer(x, slot)
        return x

    x = torch.randn(2, 4)
    cap = stampout.capture(program, x, slots)
    assert cap.stats.reuses == 2
    assert [type(s.last) for s in slots] == [torch.Tensor] * 3
