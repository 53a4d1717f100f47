"""The generated per-call check reads attributes, items and `cache.layers[self.idx]` slots inline
(guards/guard.py `_assignment`), not through getattr(.., MISSING) / _item / _slot_item: what the helpers answer
when a read finds nothing (MISSING) it still answers, so a check still refuses a call when an attribute was
deleted, a layer was dropped from the list, a dict lost a key, a slot index
is no longer an int, or a cache tensor was replaced by one of another shape, dtype or strides. Differential
against eager on twin objects; capture counts show the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout


class Layer:
    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys
        self.scale = 2.0


class Cache:
    def __init__(self, layers: list[Layer], opts: dict) -> None:
        self.layers = layers
        self.opts = opts


class Block(nn.Module):
    def __init__(self, idx: int) -> None:
        super().__init__()
        self.idx = idx
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        layer = cache.layers[self.idx]  # (a slot read: the index is a module attribute)
        scale = getattr(layer, "scale", 1.0)
        return self.lin(x) * scale + layer.keys.sum(0) + cache.opts.get("shift", 0.0)


class Model(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(i) for i in range(n))

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, cache)
        return x + len(cache.layers)


def twins(n: int = 3) -> tuple[Cache, Cache]:
    keys = [torch.randn(3, 4) for _ in range(n)]
    return (Cache([Layer(k.clone()) for k in keys], {"shift": 0.5}),
            Cache([Layer(k.clone()) for k in keys], {"shift": 0.5}))


def setup():
    torch.manual_seed(0)
    model, reference = Model(), Model()
    reference.load_state_dict(model.state_dict())
    return stampout.compile(model, backend="eager"), model, reference


def same(fn, reference, x, ours: Cache, theirs: Cache) -> None:
    torch.testing.assert_close(fn(x, ours), reference(x, theirs))


def test_each_changed_fact_is_refused_and_the_call_matches_eager():
    fn, _, reference = setup()
    x = torch.randn(2, 4)
    with torch.no_grad():
        ours, theirs = twins()
        for _ in range(2):
            same(fn, reference, x, ours, theirs)
        assert fn.stats.captures == 1
        ours, theirs = twins()  # a new cache object of the same structure: admitted
        same(fn, reference, x, ours, theirs)
        assert fn.stats.captures == 1

        changes = [  # (the change, then how many captures it makes)
            (lambda c: delattr(c.layers[1], "scale"), 1),  # an attribute deleted (getattr's default in eager)
            (lambda c: c.opts.pop("shift"), 1),  # a dict lost a key (.get's default)
            (lambda c: setattr(c.layers[2], "keys", c.layers[2].keys.repeat(2, 1)), 1),  # a tensor of another shape
            (lambda c: setattr(c.layers[0], "keys", c.layers[0].keys.half()), 1),  # ... of another dtype
            (lambda c: setattr(c.layers[0], "keys", c.layers[0].keys.t().contiguous().t()), 1),  # ... strides
            (lambda c: c.layers.append(Layer(c.layers[0].keys.clone())), 1),  # a layer more (read: len)
            (lambda c: c.layers.pop(), 0),  # that layer dropped again: the entry before it admits the call
        ]
        captures = fn.stats.captures
        for change, traced in changes:
            change(ours)
            change(theirs)
            same(fn, reference, x, ours, theirs)
            captures += traced
            assert fn.stats.captures == captures  # the changed fact was caught
            same(fn, reference, x, ours, theirs)  # and the entry that ran admits the next call
            assert fn.stats.captures == captures
        ours.layers[1].scale = theirs.layers[1].scale = 2.0  # back as at first: the first entry again
        ours.opts["shift"] = theirs.opts["shift"] = 0.5
        for c in (ours, theirs):
            c.layers[2].keys = c.layers[2].keys[:3]
            c.layers[0].keys = c.layers[0].keys.float().contiguous()
        same(fn, reference, x, ours, theirs)
        assert fn.stats.captures == captures


def test_a_slot_index_that_is_no_longer_an_int_is_refused():
    fn, model, reference = setup()
    x = torch.randn(2, 4)
    with torch.no_grad():
        ours, theirs = twins()
        for _ in range(2):
            same(fn, reference, x, ours, theirs)
        captures = fn.stats.captures
        model.blocks[0].idx = reference.blocks[0].idx = True  # layers[True] is layers[1] in eager
        same(fn, reference, x, ours, theirs)
        assert fn.stats.captures == captures + 1
        ours.layers[1].keys = torch.randn(6, 4)  # the slot now reads layer 1: a change there is seen
        theirs.layers[1].keys = ours.layers[1].keys.clone()
        same(fn, reference, x, ours, theirs)


def _closure_program():
    scale, shift = 2, 0.5

    def program(x: torch.Tensor) -> torch.Tensor:
        return x * scale + shift

    def set_scale(value) -> None:
        nonlocal scale
        scale = value

    return program, set_scale


def test_closure_cells_read_inline_see_a_new_value_and_an_emptied_cell():
    """`_cell(fn, i)` inline (`fn.__closure__[i].cell_contents`): a new value in a cell recaptures; a cell emptied
    (`del`) reads as MISSING, refused, and the call fails as eager does."""
    program, set_scale = _closure_program()
    fn = stampout.compile(program, backend="eager")
    x = torch.randn(3)
    for _ in range(2):
        torch.testing.assert_close(fn(x), program(x))
    for value, captures in ((3, 2), (3, 2), (2.5, 3), (2, 3)):  # (the int seen to change: a symbol from then on)
        set_scale(value)
        torch.testing.assert_close(fn(x), program(x))
        assert fn.stats.captures == captures, value
    del program.__closure__[0].cell_contents  # (`scale`: cells are in name order)
    with pytest.raises(NameError):
        program(x)
    with pytest.raises(NameError):
        fn(x)


def _scaled(forward):
    scale = 2.0

    def scaled_forward(self, x: torch.Tensor) -> torch.Tensor:
        return forward(self, x) * scale

    def set_scale(value) -> None:
        nonlocal scale
        scale = value

    scaled_forward.set_scale = set_scale
    return scaled_forward


class Decorated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @_scaled
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_cells_of_a_decorated_forward_read_inline_see_a_new_value_and_an_emptied_cell():
    """The cells of the class's forward (a decorator's closure, as transformers' `deprecate_kwarg`) are read
    inline per call (`fn.__closure__[i].cell_contents`): a new value recaptures; an emptied cell is refused."""
    torch.manual_seed(0)
    model = Decorated()
    fn = stampout.compile(model, backend="eager")
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(fn(x), model(x))
        Decorated.forward.set_scale(3.0)
        torch.testing.assert_close(fn(x), model(x))
        torch.testing.assert_close(fn(x), model(x))
        assert fn.stats.captures == 2
        cell = Decorated.forward.__closure__[[c.cell_contents for c in Decorated.forward.__closure__].index(3.0)]
        del cell.cell_contents
        with pytest.raises(NameError):
            model(x)
        with pytest.raises(NameError):
            fn(x)
