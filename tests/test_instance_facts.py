"""The per-call check's memo on plain instance state (guards/instance_facts.py): a compiled decode step over a
static-cache-like object whose layers hold tensors and plain attributes, the memo answering the calls before a
change. Each change the memo's C++ facts must see is made to a compiled cache and to an eager twin between
calls: a write that bypasses `__setattr__`, a replaced `__dict__`, a swapped or appended list item, an attribute
put on the layer's class or on a base swapped in (the layer had none: guarded absent), a `__class__`
assignment, an in-place resize, a `set_` onto another tensor's memory. Outputs and cache tensors are compared
with eager, with the exact number of captures."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import stampout

LAYERS, SLOTS, DIM = 3, 6, 4
OFFSET = 0.0  # (a global the step reads: vouched for by the globals' dict version)


class Root:
    pass


class WithBias:
    bias = 1.0


def _classes() -> tuple[type, type]:
    """Fresh cache classes per test: some changes write to the layer's class."""

    class CacheLayer(Root):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, scale: float = 0.5) -> None:
            self.keys = keys
            self.values = values
            self.length = torch.zeros((), dtype=torch.int64)
            self.scale = scale  # (a constant the step reads: guarded per call, settled by the memo)
            self.causal = True

    class Cache:
        def __init__(self, layers: list) -> None:
            self.layers = layers

    return CacheLayer, Cache


class Block(nn.Module):
    def __init__(self, idx: int) -> None:
        super().__init__()
        self.idx = idx
        self.q = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, position: torch.Tensor, cache) -> torch.Tensor:
        layer = cache.layers[self.idx]
        layer.keys.index_copy_(0, position, x)
        layer.values.index_copy_(0, position, x * 2)
        layer.length.add_(1)
        att = torch.softmax(self.q(x) @ layer.keys.t() * layer.scale, -1)
        out = x + att @ layer.values + layer.length + OFFSET
        bias = getattr(layer, "bias", None)  # (absent from the layer and its classes: guarded absent)
        if bias is not None:
            out = out + bias
        return out if layer.causal else -out


Block.original_forward = Block.forward


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(i) for i in range(LAYERS))

    def forward(self, x: torch.Tensor, position: torch.Tensor, cache) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, position, cache)
        return x


def _randn(*shape: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Twins:
    """A compiled decoder and its eager twin, each with its own cache of equal contents."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.CacheLayer, self.Cache = _classes()
        self.model = Decoder()
        self.fn = stampout.compile(self.model, backend="aot_eager")
        self.ours, self.theirs = self.cache(), self.cache()
        self.x = torch.randn(1, DIM)

    def cache(self):
        return self.Cache([self.CacheLayer(_randn(SLOTS, DIM, seed=i), _randn(SLOTS, DIM, seed=10 + i))
                           for i in range(LAYERS)])

    def step(self, position: int) -> None:
        pos = torch.tensor([position])
        with torch.no_grad():
            got = self.fn(self.x, pos, self.ours)
            expected = self.model(self.x, pos, self.theirs)
        torch.testing.assert_close(got, expected)
        for a, b in zip(self.ours.layers, self.theirs.layers):
            for name in ("keys", "values", "length"):
                torch.testing.assert_close(getattr(a, name), getattr(b, name))

    def both(self, change: Callable) -> None:
        change(self, self.ours)
        change(self, self.theirs)

    def memo_hits(self) -> int:
        (entry,) = self.fn._compiled._entries
        return entry.held.hits


def _dict_write(twins, cache):
    cache.layers[1].__dict__["scale"] = 2.0


def _object_setattr(twins, cache):
    object.__setattr__(cache.layers[2], "causal", False)


def _replaced_dict(twins, cache):
    layer = cache.layers[0]
    object.__setattr__(layer, "__dict__", {**vars(layer), "scale": 3.0})


def _swapped_item(twins, cache):
    cache.layers[1] = twins.CacheLayer(_randn(SLOTS, DIM), _randn(SLOTS, DIM, seed=8), scale=1.5)


def _appended_item(twins, cache):
    cache.layers.append(twins.CacheLayer(_randn(SLOTS, DIM), _randn(SLOTS, DIM)))


def _attribute_on_class(twins, cache):
    twins.CacheLayer.bias = 1.0  # (both twins share the class: set twice)


def _base_swapped(twins, cache):
    twins.CacheLayer.__bases__ = (WithBias,)


def _class_assigned(twins, cache):
    layer = cache.layers[2]
    layer.__class__ = type("Other", (twins.CacheLayer,), {"bias": 1.0})


def _global_rebound(twins, cache):
    globals()["OFFSET"] = 1.0  # (both twins read it: set twice)


def _method_replaced(twins, cache):
    type.__setattr__(Block, "forward", _forward_plus_one)


def _forward_plus_one(self, x, position, cache):
    return Block.original_forward(self, x, position, cache) + 1


def _resized(twins, cache):
    for t in (cache.layers[1].keys, cache.layers[1].values):
        t.resize_(SLOTS + 2, DIM)
        t[SLOTS:] = 0


def _set_onto_other(twins, cache):
    keys = cache.layers[1].keys  # now over layer 0's values' bytes (same sizes, strides and offset)
    keys.set_(cache.layers[0].values.untyped_storage(), 0, keys.shape, keys.stride())


# Each changes what the capture read (a constant, the class's attribute lookup, a tensor's metadata or aliasing):
# one recapture, then the memo is made again and answers.
RECAPTURED = {"dict-write": _dict_write, "object-setattr": _object_setattr, "replaced-dict": _replaced_dict,
              "swapped-item": _swapped_item, "appended-item": _appended_item, "attribute-on-class": _attribute_on_class,
              "base-swapped": _base_swapped, "class-assigned": _class_assigned, "global-rebound": _global_rebound,
              "method-replaced": _method_replaced, "resized": _resized,
              "set-onto-other": _set_onto_other}


@pytest.fixture(autouse=True)
def _restored():
    yield
    globals()["OFFSET"] = 0.0
    type.__setattr__(Block, "forward", Block.original_forward)


@pytest.mark.parametrize("change", RECAPTURED.values(), ids=RECAPTURED.keys())
def test_a_change_behind_the_memo_is_seen(change):
    twins = Twins()
    for position in range(3):
        twins.step(position)
    before = twins.memo_hits()
    assert before >= 1  # (the memo answered: the change below happens behind it)
    twins.both(change)
    for position in range(3, 5):
        twins.step(position)
    assert twins.fn.stats.captures == 2


def _same_contents_new_objects(twins, cache):
    for layer in cache.layers:
        object.__setattr__(layer, "__dict__", dict(vars(layer)))  # (another dict, the same entries)
    cache.layers[2] = twins.CacheLayer(_randn(SLOTS, DIM), _randn(SLOTS, DIM, seed=9))


def test_new_objects_with_equal_facts_are_admitted_and_read_afresh():
    twins = Twins()
    for position in range(3):
        twins.step(position)
    twins.both(_same_contents_new_objects)
    hits = twins.memo_hits()
    for position in range(3, 6):
        twins.step(position)
    assert twins.fn.stats.captures == 1
    assert twins.memo_hits() == hits + 2  # (the first call after: a full check, which made a new memo)


class StoringBlock(Block):
    """A dynamic cache's step: the layer's tensors stored anew each call (same shapes), so the layer's dict is written
    every call and the memo checks it entry by entry, reading the tensors per call."""

    def forward(self, x: torch.Tensor, position: torch.Tensor, cache) -> torch.Tensor:
        layer = cache.layers[self.idx]
        layer.keys = layer.keys * 0.5 + x
        layer.values = layer.values * 0.5 - x
        att = torch.softmax(self.q(x) @ layer.keys.t() * layer.scale, -1)
        out = x + att @ layer.values
        bias = getattr(layer, "bias", None)
        if bias is not None:
            out = out + bias
        return out if layer.causal else -out


class StoringTwins(Twins):
    def __init__(self) -> None:
        super().__init__()
        self.model.blocks = nn.ModuleList(StoringBlock(i) for i in range(LAYERS))
        self.fn = stampout.compile(self.model, backend="aot_eager")


def _set_keys_onto_values(twins, cache):
    layer = cache.layers[1]  # (the next step reads both, then stores new ones)
    layer.keys.set_(layer.values.untyped_storage(), 0, layer.keys.shape, layer.keys.stride())


# The entry-by-entry memo: what it vouches for (the layers, their constants, the classes) changed behind it.
STORED = {"dict-write": _dict_write, "object-setattr": _object_setattr, "swapped-item": _swapped_item,
          "attribute-on-class": _attribute_on_class, "class-assigned": _class_assigned,
          "set-onto-other": _set_keys_onto_values}


@pytest.mark.parametrize("change", STORED.values(), ids=STORED.keys())
def test_a_change_behind_the_entry_by_entry_memo_is_seen(change):
    twins = StoringTwins()
    for position in range(8):  # (three memos fail at once, as the dicts are written: then entry by entry)
        twins.step(position)
    (entry,) = twins.fn._compiled._entries
    hits = twins.memo_hits()
    assert entry.held._mode == 1 and hits >= 2
    twins.both(change)
    for position in range(8, 10):
        twins.step(position)
    assert twins.fn.stats.captures == 2


def test_the_entry_by_entry_memo_answers_while_tensors_are_stored_anew():
    twins = StoringTwins()
    for position in range(8):
        twins.step(position)
    hits = twins.memo_hits()
    for position in range(8, 12):
        twins.step(position)
    assert twins.fn.stats.captures == 1 and twins.memo_hits() == hits + 4


def test_a_memo_that_cannot_be_built_leaves_the_full_check(monkeypatch):
    """Building a memo is an optimization: where it raises, the entry keeps checking every call in full (no memo
    answers, no error reaches the caller) and a change between calls is still seen."""
    from stampout.guards import instance_facts

    def broken(*args, **kwargs):
        raise RuntimeError("no memo")

    monkeypatch.setattr(instance_facts, "_Builder", broken)
    twins = Twins()
    for position in range(3):
        twins.step(position)
    assert twins.memo_hits() == 0
    twins.both(_dict_write)
    for position in range(3, 5):
        twins.step(position)
    assert twins.fn.stats.captures == 2


class Inputs:
    """A plain object a caller passes: its tensor is read through it (vouched for by the memo)."""

    def __init__(self, scale: float) -> None:
        self.weight = torch.full((DIM,), scale)
        self.scale = 0.5  # (a constant: the same in each)
        self.meta = Root()  # (a field the step reads: `inputs.meta.shift`)
        self.meta.shift = 1.0


def _scaled(x: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    return x * inputs.weight + inputs.scale + inputs.meta.shift


def test_the_memo_lets_go_of_an_input_the_caller_lets_go_of():
    """The memo holds what it vouched for alive (its facts compare ids), but the call's inputs only weakly: an input
    the caller drops after the call dies as in eager (with its tensors), and the memo it vouched for answers no more
    (was: the last call's input object and what it held were kept alive until the next call)."""
    import gc
    import weakref

    fn = stampout.compile(_scaled, backend="eager")
    x = torch.randn(DIM)
    kept = Inputs(1.0)
    for _ in range(3):  # (a memo answers while the caller holds its input)
        torch.testing.assert_close(fn(x, kept), _scaled(x, kept))
    (entry,) = fn._entries
    assert entry.held.hits >= 1
    for scale in (2.0, 3.0, 4.0):
        inputs = Inputs(scale)
        torch.testing.assert_close(fn(x, inputs), _scaled(x, inputs))
        dead, meta = weakref.ref(inputs), weakref.ref(inputs.meta)
        del inputs
        gc.collect()
        assert dead() is None and meta() is None
        assert entry.held._memo is None
    assert fn.stats.captures == 1


class Tables:
    """A user class read as a value: its dict and list class attributes (transformers' `_tp_plan`,
    `_no_split_modules`) are guarded by value, and settled by the memo's facts (the dict's version; the list's length
    and items by identity)."""

    gains = {"a": 1.0, "b": 2.0}
    names = ["a", "b"]


class ReadsTables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * Tables.gains[Tables.names[0]] + len(Tables.names)


TABLE_CHANGES = {
    "dict-item": lambda: Tables.gains.__setitem__("a", 3.0),
    "list-item": lambda: Tables.names.__setitem__(0, "b"),
    "list-append": lambda: Tables.names.append("c"),
}


@pytest.mark.parametrize("change", TABLE_CHANGES.values(), ids=TABLE_CHANGES.keys())
def test_a_class_table_changed_in_place_behind_the_memo_is_seen(change, monkeypatch):
    from stampout.guards import instance_facts

    rest: list = []  # (the guards each memo still runs in Python)
    compile_guards = instance_facts.compile_guards
    monkeypatch.setattr(instance_facts, "compile_guards", lambda guards, *a: rest.append(guards) or compile_guards(
        guards, *a))
    monkeypatch.setattr(Tables, "gains", {"a": 1.0, "b": 2.0})
    monkeypatch.setattr(Tables, "names", ["a", "b"])
    torch.manual_seed(0)
    model, x = ReadsTables(), torch.randn(2, DIM)
    fn = stampout.compile(model, backend="eager")
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(fn(x), model(x))
        (entry,) = fn._compiled._entries
        assert entry.held.hits >= 1 and rest
        tables = ("Tables.__dict__['gains']", "Tables.__dict__['names']")
        assert not [g for g in rest[-1] if g.source.name() in tables]  # (settled by the facts)
        change()
        torch.testing.assert_close(fn(x), model(x))
        assert fn.stats.captures == 2
