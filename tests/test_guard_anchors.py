"""The per-call check starts from objects reached through watched modules (anchors), each checked once: a
config shared by every layer is read once per call, and a write that splits what was shared is seen."""

from __future__ import annotations

import copy

import torch
from helpers import same
from test_divergent import Stack

import stampout


def compiled_pair(n: int = 4):
    torch.manual_seed(0)
    model = Stack(n)
    return model, copy.deepcopy(model), stampout.compile(model, backend="eager")


def test_shared_config_is_checked_once_per_call():
    """Every layer reads `self.cfg.act` of one shared config: the generated per-call check reads it once."""
    for n in (2, 24):
        model, reference, fn = compiled_pair(n)
        same(fn, reference, torch.randn(3, 8))
        (entry,) = getattr(fn, "_compiled", fn)._entries  # a CompiledModule wraps its CompiledFunction
        reads = [line for line in entry.always.source_code.splitlines() if line.endswith(".act")]
        assert len(reads) == 1, reads  # the instance's attribute read once (its class's default: an item read)


def test_shared_config_field_change_recaptures():
    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    same(fn, reference, x)
    model.cfg.act = reference.cfg.act = "gelu"  # not a module: no write watch, seen by the per-call check
    same(fn, reference, x)
    assert fn.stats.captures == 2


def test_config_no_longer_shared_is_seen():
    """One layer gets its own (equal) copy of the shared config, then only that copy changes."""
    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    same(fn, reference, x)
    same(fn, reference, x)
    for m in (model, reference):
        m.layers[2].cfg = copy.copy(m.cfg)
    same(fn, reference, x)  # equal values; the entry's per-call check read one config for all layers
    assert fn.stats.captures <= 2  # (an entry whose shared objects were split is dropped: one recapture)
    before = fn.stats.captures
    for m in (model, reference):
        m.layers[2].cfg.act = "relu"
    same(fn, reference, x)
    same(fn, reference, x)
    assert fn.stats.captures == before + 1


def test_config_replaced_through_the_instance_dict_is_seen():
    """A write that bypasses `__setattr__` (no epoch bump) to an anchored object's holder is still seen."""
    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    same(fn, reference, x)
    for m in (model, reference):
        m.layers[1].__dict__["cfg"] = type(m.cfg)(act="gelu")
    same(fn, reference, x)
    assert fn.stats.captures == 2


def test_dropped_entry_is_explained(caplog):
    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    same(fn, reference, x)
    for m in (model, reference):
        m.layers[2].cfg = copy.copy(m.cfg)
    with caplog.at_level("INFO", logger="stampout.guards"):
        same(fn, reference, x)
    assert "objects its per-call check shared differ" in caplog.text
