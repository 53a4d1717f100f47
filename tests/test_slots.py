"""Per-layer indices (`self.layer_idx`) that only pick the layer's own entry of a list do not defeat reuse;
any other use of the index (arithmetic, a branch, a torch call, a C function, a closure) keeps it a guarded
constant, so each value is traced on its own and the result stays right."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout


class Bank:
    """A cache-like object: one entry per layer, in a list."""

    def __init__(self, n: int) -> None:
        self.entries = [torch.randn(4) * (i + 1) for i in range(n)]


def _take(entries, i):
    return entries[i]


def _pick(bank, i):
    return bank.entries[i]


def _type_scale(bank, i):
    scale = 2.0 if type(i) is int else 3.0
    return bank.entries[i] * scale


def _from_generator(bank, i):
    yield type(i) is int
    yield bank.entries[i]


def _take_plus_zero(entries, i):
    return entries[i + 0]


NO_OPTIONS: dict = {}
USES = {
    "index": lambda self, x, bank: x * bank.entries[self.idx],
    "via_helper": lambda self, x, bank: x * _pick(bank, self.idx),
    "via_helper_kwargs": lambda self, x, bank: x * _pick(bank, self.idx, **NO_OPTIONS),  # (CALL_FUNCTION_EX)
    "arithmetic_in_helper_kwargs": lambda self, x, bank: x * _take_plus_zero(bank.entries, self.idx, **NO_OPTIONS),
    "container_to_helper": lambda self, x, bank: x * _take(bank.entries, self.idx),
    "via_local": lambda self, x, bank: (lambda i: x * bank.entries[i])(self.idx),
    "arithmetic_in_helper": lambda self, x, bank: x * _take_plus_zero(bank.entries, self.idx),
    "branch": lambda self, x, bank: x * bank.entries[self.idx] * (2 if self.idx % 2 else 3),
    "scale": lambda self, x, bank: x * self.idx,
    "torch_call": lambda self, x, bank: x * torch.full((4,), self.idx),
    "range": lambda self, x, bank: x * len(list(range(self.idx))),
    "literal_and_index": lambda self, x, bank: x * bank.entries[0] + bank.entries[self.idx],
    # the program must see a plain int wherever its type could matter
    "type_check": lambda self, x, bank: x * (2.0 if type(self.idx) is int else 3.0) * bank.entries[self.idx],
    "type_in_helper": lambda self, x, bank: x * _type_scale(bank, self.idx),
    "generator": lambda self, x, bank: (lambda g: x * (2.0 if next(g) else 3.0) * next(g))(
        _from_generator(bank, self.idx)),
}
# traces for 4 layers: 1 when the index only picks the layer's entry of a list read right there, else one per
# layer (the list handed to a helper, or also indexed with a literal: stampout cannot tell which item is which)
TRACES = {"index": 1, "via_helper": 1, "via_helper_kwargs": 1}


def _model(use: str, n: int = 4) -> nn.Module:
    body = USES[use]

    class Layer(nn.Module):
        def __init__(self, idx: int) -> None:
            super().__init__()
            self.idx = idx
            self.lin = nn.Linear(4, 4)

        @stampout.region
        def forward(self, x, bank):
            return body(self, self.lin(x), bank)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer(i) for i in range(n))

        def forward(self, x, bank):
            for layer in self.layers:
                x = layer(x, bank)
            return x

    torch.manual_seed(0)
    return Model()


@pytest.mark.parametrize("use", list(USES))
def test_layer_index_reuse_only_when_it_only_picks_an_entry(use):
    model, bank, x = _model(use), Bank(4), torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x, bank)
        cap = stampout.capture(model, x, bank)
        cap.gm.graph.lint()
        torch.testing.assert_close(cap(x, bank), expected)
        other = Bank(4)  # each call reads its own object's entries
        torch.testing.assert_close(cap(x, other), model(x, other))
    assert cap.stats.traces + cap.stats.dedups == TRACES.get(use, 4)
    assert cap.stats.traces + cap.stats.dedups + cap.stats.reuses == 4


def test_layer_index_changed_after_capture_is_seen_by_compile():
    model, bank, x = _model("index"), Bank(4), torch.randn(2, 4)
    fn = stampout.compile(model, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(fn(x, bank), model(x, bank))
        model.layers[1].idx, model.layers[2].idx = 2, 1  # the layers now read each other's entries
        torch.testing.assert_close(fn(x, bank), model(x, bank))
        model.layers[3].idx = 7  # out of range: eager raises, and so must the compiled call
        with pytest.raises(IndexError):
            model(x, bank)
        with pytest.raises(IndexError):
            fn(x, bank)


def test_layer_index_used_as_a_dict_key_is_a_constant():
    class Layer(nn.Module):
        def __init__(self, idx):
            super().__init__()
            self.idx = idx

        @stampout.region
        def forward(self, x, table):
            return x * table[self.idx]

    layers = [Layer(i) for i in range(3)]
    table = {i: torch.randn(4) for i in range(3)}

    def program(x, table):
        for layer in layers:
            x = layer(x, table)
        return x

    x = torch.randn(4)
    cap = stampout.capture(program, x, table)
    torch.testing.assert_close(cap(x, table), program(x, table))
    assert cap.stats.traces + cap.stats.dedups == 3


class Holder:
    def __init__(self, entries) -> None:
        self.entries = entries


def _scale(v):
    return lambda x: x * v


# (name, entries, region body): items a slot must not rename blindly — their parts or metadata were read at the
# traced layer's literal index (red-team findings); each must equal eager whatever the trace count.
PICKS = {
    "shapes_differ": ([torch.full((4,), 2.0), torch.ones(2, 4), torch.ones(2, 4)],
                      lambda self, x, h: x * h.entries[self.idx] if h.entries[self.idx].dim() == 1
                      else x + h.entries[self.idx].sum(0)),
    "tuple_items": ([(torch.randn(4), torch.randn(4)) for _ in range(3)],
                    lambda self, x, h: x * h.entries[self.idx][0] + h.entries[self.idx][1]),
    "function_items": ([_scale(1.0), _scale(2.0), _scale(3.0)], lambda self, x, h: h.entries[self.idx](x) + 1),
    "literal_then_slot_at_one_site": ([torch.randn(4) for _ in range(3)],
                                      lambda self, x, h: x * [h.entries[0 if k == 0 else self.idx]
                                                              for k in range(2)][0]),
}


@pytest.mark.parametrize("name", sorted(PICKS))
def test_slot_picks_that_must_not_be_stamped_with_the_traced_entry(name):
    entries, body = PICKS[name]

    class Layer(nn.Module):
        def __init__(self, idx: int) -> None:
            super().__init__()
            self.idx = idx

        @stampout.region
        def forward(self, x, h):
            return body(self, x, h)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer(i) for i in range(3))

        def forward(self, x, h):
            for layer in self.layers:
                x = layer(x, h)
            return x

    model, x, holder = Model(), torch.randn(4), Holder(entries)
    cap = stampout.capture(model, x, holder)
    torch.testing.assert_close(cap(x, holder), model(x, holder))
