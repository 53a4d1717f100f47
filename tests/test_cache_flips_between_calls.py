"""A compiled decode step on a static-cache-like object (per layer: keys, values and a position tensor, written in
place each step), with one thing about the cache flipped between compiled calls: a tensor swapped for another,
resized or re-strided in place, moved onto another storage, two layers' tensors swapped or made one, a layer
replaced. Each step is compared with eager on a twin cache (outputs and every cache tensor after the call), with
the exact number of captures: the cheap per-call checks (guards.DeferredTensors, per_call_aliases.py) must see
every such change that matters, and admit the ones that do not."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import stampout
from stampout.compile import per_call_aliases

LAYERS, SLOTS, DIM = 3, 6, 4


class CacheLayer:
    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = keys
        self.values = values
        self.length = torch.zeros((), dtype=torch.int64)


class Cache:
    def __init__(self, layers: list[CacheLayer]) -> None:
        self.layers = layers


def cache_of(seed: int) -> Cache:
    g = torch.Generator().manual_seed(seed)
    return Cache([CacheLayer(torch.randn(SLOTS, DIM, generator=g), torch.randn(SLOTS, DIM, generator=g))
                  for _ in range(LAYERS)])


class Block(nn.Module):
    def __init__(self, idx: int) -> None:
        super().__init__()
        self.idx = idx
        self.q = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, position: torch.Tensor, cache: Cache) -> torch.Tensor:
        layer = cache.layers[self.idx]
        layer.keys.index_copy_(0, position, x)  # (a static cache's update: in place, at the step's position)
        layer.values.index_copy_(0, position, x * 2)
        layer.length.add_(1)
        att = torch.softmax(self.q(x) @ layer.keys.t(), -1)
        return x + att @ layer.values + layer.length


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(i) for i in range(LAYERS))

    def forward(self, x: torch.Tensor, position: torch.Tensor, cache: Cache) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, position, cache)
        return x


def _tensors(cache: Cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in (layer.keys, layer.values, layer.length)]


class Twins:
    """A compiled decoder and its eager twin, each with its own cache of equal contents."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = Decoder()
        self.fn = stampout.compile(self.model, backend="aot_eager")
        self.ours, self.theirs = cache_of(1), cache_of(1)
        self.x = torch.randn(1, DIM)

    def step(self, position: int = 0) -> None:
        pos = torch.tensor([position])
        with torch.no_grad():
            got = self.fn(self.x, pos, self.ours)
            expected = self.model(self.x, pos, self.theirs)
        torch.testing.assert_close(got, expected)
        for a, b in zip(_tensors(self.ours), _tensors(self.theirs)):
            torch.testing.assert_close(a, b)
            assert (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset())

    def both(self, flip: Callable[[Cache], None]) -> None:
        flip(self.ours)
        flip(self.theirs)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(7))  # (the same for both twins)


def _swapped(cache: Cache) -> None:
    cache.layers[1].keys = _randn(SLOTS, DIM)


def _replaced_layer(cache: Cache) -> None:
    cache.layers[2] = CacheLayer(_randn(SLOTS, DIM), _randn(SLOTS, DIM) * 2)


def _two_layers_swapped(cache: Cache) -> None:
    a, b = cache.layers[0], cache.layers[1]
    a.keys, b.keys = b.keys, a.keys


def _same_memory_new_object(cache: Cache) -> None:
    layer = cache.layers[0]
    layer.keys = layer.keys.detach()  # (another tensor object over the same bytes)


def _moved_storage_same_layout(cache: Cache) -> None:
    keys = cache.layers[1].keys
    keys.set_(keys.clone().untyped_storage(), 0, keys.shape, keys.stride())


# Flips the compiled call must admit as it is (same metadata, aliasing as at capture): one capture in all.
ADMITTED = {"swapped": _swapped, "replaced-layer": _replaced_layer, "two-layers-swapped": _two_layers_swapped,
            "same-memory-new-object": _same_memory_new_object, "moved-storage": _moved_storage_same_layout}


@pytest.mark.parametrize("flip", ADMITTED.values(), ids=ADMITTED.keys())
def test_a_flip_with_equal_metadata_and_aliasing_is_admitted_and_read_afresh(flip):
    twins = Twins()
    for position in range(3):
        twins.step(position)
    twins.both(flip)
    for position in range(3, 5):
        twins.step(position)
    assert twins.fn.stats.captures == 1


def _resized(cache: Cache) -> None:
    for t in (cache.layers[1].keys, cache.layers[1].values):  # (the two grow together: attention reads both)
        t.resize_(SLOTS + 2, DIM)
        t[SLOTS:] = 0


def _restrided(cache: Cache) -> None:
    keys = cache.layers[2].keys
    keys.set_(_randn(DIM, SLOTS).untyped_storage(), 0, (SLOTS, DIM), (1, SLOTS))  # column-major, same sizes


def _offset_moved(cache: Cache) -> None:
    keys = cache.layers[0].keys
    storage = _randn(SLOTS * DIM + 8).untyped_storage()
    keys.set_(storage, 8, keys.shape, keys.stride())  # same sizes and strides, another storage offset


def _made_one(cache: Cache) -> None:
    cache.layers[2].values = cache.layers[1].values  # two layers write one tensor


def _made_overlapping(cache: Cache) -> None:
    keys = cache.layers[1].keys  # now over layer 0's values' bytes (same sizes, strides and offset)
    keys.set_(cache.layers[0].values.untyped_storage(), 0, keys.shape, keys.stride())


# Flips that change what the capture assumed (metadata, aliasing): one recapture each, then admitted.
RECAPTURED = {"resized": _resized, "re-strided": _restrided, "offset-moved": _offset_moved, "made-one": _made_one,
              "made-overlapping": _made_overlapping}


@pytest.mark.parametrize("flip", RECAPTURED.values(), ids=RECAPTURED.keys())
def test_a_flip_of_metadata_or_aliasing_recaptures_once(flip):
    twins = Twins()
    for position in range(3):
        twins.step(position)
    twins.both(flip)
    for position in range(3, 5):
        twins.step(position)
    assert twins.fn.stats.captures == 2


def test_new_objects_over_the_same_bytes_take_the_remembered_aliasing_answer(monkeypatch):
    """The per-call tensors' byte ranges are apart: their data pointers alone decide (per_call_aliases.py), so
    new tensor objects over the same bytes do not redo the full aliasing answer; results stay eager's."""
    twins = Twins()
    for position in range(3):
        twins.step(position)
    full: list[int] = []
    aliases_of = per_call_aliases.aliases_of
    monkeypatch.setattr(per_call_aliases, "aliases_of", lambda leaves: full.append(1) or aliases_of(leaves))
    twins.both(lambda cache: [setattr(layer, "keys", layer.keys.detach()) for layer in cache.layers])
    for position in range(3, 5):
        twins.step(position)
    assert full == [] and twins.fn.stats.captures == 1
