"""When an entry makes an instance-facts memo (guards/instance_facts.py, the note on when a memo is made): making one
costs about as much as _PAYS full checks, so an entry called once per generate on a new cache makes none after its
first, while one called again and again on the same cache keeps one. Every call's answer is the full check's."""

from __future__ import annotations

import pytest
import torch

from stampout.guards.guard import Guard, compile_guards
from stampout.guards.instance_facts import _PAYS, _STRIKES, InstanceFacts
from stampout.guards.rules import Kind
from stampout.sources import Arg, Attr, Item


class Layer:
    def __init__(self) -> None:
        self.keys = torch.zeros(2)


class Cache:
    def __init__(self, n: int = 4) -> None:
        self.layers = [Layer() for _ in range(n)]


def _guards(n: int = 4) -> list[Guard]:
    """A decode step's: the cache's layers distinct, the input distinct from their tensors."""
    layers = Attr(Arg(2, "cache"), "layers")
    items = [Item(layers, i) for i in range(n)]
    return [Guard(items[0], Kind.DISTINCT, tuple(items[1:])),
            Guard(Arg(1, "x"), Kind.DISTINCT, tuple(Attr(item, "keys") for item in items))]


class Entry:
    """An entry's per-call check and its memo, counting the memos made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        guards = _guards()
        self.held = InstanceFacts(guards, [Arg(2, "cache")], [])
        self.check = compile_guards(guards, [Arg(2, "cache")])
        self.made = 0
        make = InstanceFacts._make

        def counted(held, *args):
            self.made += 1
            return make(held, *args)

        monkeypatch.setattr(InstanceFacts, "_make", counted)

    def call(self, cache: Cache) -> None:
        values = self.held.run(self.check, [None, torch.ones(2), cache], None, ())
        assert values is not False and values[0] is cache  # (the full check's answer, memo or not)


def test_an_entry_called_once_per_generate_on_a_new_cache_stops_making_memos(monkeypatch):
    """The prefill entry: each memo would die unused at the next generate (old: six memos, ~3 ms each at 8 layers)."""
    entry = Entry(monkeypatch)
    for _ in range(8):
        entry.call(Cache())
    assert entry.made == 1 and entry.held.hits == 0


def test_a_steady_entry_is_memoized_at_once(monkeypatch):
    entry = Entry(monkeypatch)
    cache = Cache()
    for _ in range(3):
        entry.call(cache)
    assert entry.made == 1 and entry.held.hits == 2
    for _ in range(40):
        entry.call(cache)
    assert entry.made == 1 and entry.held.hits == 42


def test_an_entry_alternating_two_objects_makes_one_memo(monkeypatch):
    entry = Entry(monkeypatch)
    a, b = Cache(), Cache()
    for _ in range(8):
        entry.call(a)
        entry.call(b)
    assert entry.made == 1 and entry.held.hits == 0


def test_short_generates_stop_making_memos_and_a_long_one_makes_one_again(monkeypatch):
    """The decode step entry: generates of 8 steps, each on a new cache: the first generate's memo did not pay
    (7 hits), so the later ones check in full; a generate that lasts makes a memo once its run has lasted _PAYS
    full checks, and after that one paid, the next generate's memo is made at its first step."""
    entry = Entry(monkeypatch)
    for _ in range(4):
        cache = Cache()
        for _ in range(8):
            entry.call(cache)
    assert entry.made == 1 and entry.held.hits == 7
    cache = Cache()
    for _ in range(_PAYS + 20):
        entry.call(cache)
    assert entry.made == 2 and entry.held.hits == 7 + 20
    cache = Cache()
    for _ in range(3):
        entry.call(cache)
    assert entry.made == 3 and entry.held.hits == 7 + 20 + 2


def test_a_memo_that_fails_on_the_same_objects_is_made_again_at_once(monkeypatch):
    """A write to a vouched instance dict (a dynamic cache's step stores new tensors) fails the memo on the same
    cache: the entry makes the next one at once (the strikes then switch to entry by entry)."""
    entry = Entry(monkeypatch)
    cache = Cache()
    entry.call(cache)
    for step in range(_STRIKES):
        cache.layers[step].keys = torch.zeros(2)
        entry.call(cache)
    assert entry.made == 1 + _STRIKES and entry.held._mode == 1
    entry.call(cache)
    assert entry.held.hits == 1


def test_an_input_that_died_does_not_pass_for_a_new_one_with_its_id(monkeypatch):
    """The run holds the inputs weakly: a new cache that takes a dead one's id is a new run, not the same."""
    entry = Entry(monkeypatch)
    entry.call(Cache())
    for _ in range(_PAYS + 4):
        entry.call(Cache())  # (each dies after its call: its id is free for the next)
    assert entry.made == 1


def test_the_run_holds_no_input_alive(monkeypatch):
    import gc
    import weakref

    entry = Entry(monkeypatch)
    cache = Cache()
    for _ in range(3):
        entry.call(cache)
    entry.call(Cache())  # (the memo dies unpaid: the entry then only keeps the run)
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None

