"""reuse_hash_fn, structural dedup, explain(), STAMPOUT_LOGS logging and error messages of regions."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import assert_matches_eager
from torch import nn

import stampout


class Lin(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.mode = "a"

    def forward(self, x):
        return self.lin(x) + 1


def test_reuse_hash_fn_shares_one_trace_without_guards():
    @stampout.region(reuse_hash_fn=lambda layer, x: 7)
    def block(layer, x):
        return layer(x)

    a, b = Lin(), Lin()
    b.mode = "b"  # never read; with a hash key nothing is guarded anyway
    cap = stampout.capture(lambda x: block(b, block(a, x)), torch.randn(2, 4))
    assert (cap.stats.traces, cap.stats.reuses) == (1, 1)
    x = torch.randn(2, 4)
    torch.testing.assert_close(cap(x), b(a(x)))


def test_reuse_hash_fn_must_return_int():
    @stampout.region(reuse_hash_fn=lambda x: "key")
    def block(x):
        return x + 1

    with pytest.raises(stampout.RegionError, match="returned 'key'"):
        stampout.capture(block, torch.randn(2))


def test_reuse_hash_fn_same_key_different_inputs_raises():
    @stampout.region(reuse_hash_fn=lambda x: 1)
    def block(x):
        return x + 1

    with pytest.raises(stampout.RegionError, match="different inputs") as info:
        stampout.capture(lambda x: block(block(x)[:1]), torch.randn(4))
    assert "shape=[1]" in str(info.value) and "shape=[4]" in str(info.value)


def test_reuse_hash_fn_with_side_effect_raises():
    @stampout.region(reuse_hash_fn=lambda holder, x: 1)
    def block(holder, x):
        holder.calls = holder.calls + 1
        return x + 1

    holder = Lin()
    holder.calls = 0
    with pytest.raises(stampout.RegionError, match="side effect"):
        stampout.capture(lambda x: block(holder, x), torch.randn(2))
    assert holder.calls == 1  # the region's Python ran once, then the entry was refused


class Branchy(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.mode = mode

    @stampout.region
    def forward(self, x):
        if self.mode == "a":
            return self.lin(x) * 2
        return self.lin(x) * 2  # same computation, other branch


def test_identical_traces_are_deduped():
    model = nn.Sequential(Branchy("a"), Branchy("b"), Branchy("a"))
    cap = assert_matches_eager(model, torch.randn(2, 4), grad=True)
    assert (cap.stats.traces, cap.stats.dedups, cap.stats.reuses, cap.stats.subgraphs) == (1, 1, 1, 1)
    assert [e.outcome for e in cap.events] == ["traced", "deduped", "reused"]


def test_explain_names_the_guard_and_the_line():
    model = nn.Sequential(Branchy("a"), Branchy("b"))
    model[1].forward.__self__ if hasattr(model[1].forward, "__self__") else None
    report = stampout.explain(model, torch.randn(2, 4))
    assert "deduped" in report
    assert "self.mode" in report
    assert "'a'" in report and "'b'" in report
    assert "test_region_reports.py" in report


def test_logs_each_outcome_and_the_miss_reason(caplog):
    logger = logging.getLogger("stampout.regions")
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        with caplog.at_level(logging.DEBUG, logger="stampout.regions"):
            stampout.capture(nn.Sequential(Branchy("a"), Branchy("a"), Branchy("b")), torch.randn(2, 4))
    finally:
        logger.setLevel(old)
    text = caplog.text
    assert text.count("Branchy.forward") == 3
    assert "reused" in text and "traced (first call)" in text
    assert "constant of self.mode: expected" in text


def test_stampout_logs_env_var_configures_loggers(monkeypatch):
    from stampout._logging import configure

    logger = logging.getLogger("stampout.regions")
    old = logger.level
    try:
        configure("+regions")
        assert logger.level == logging.DEBUG
        configure("regions")
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(old)


SETTINGS = {"shift": 1.0}


class ReadsGlobalInSubmodule(nn.Module):
    def forward(self, x):
        return x + SETTINGS["shift"]


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = ReadsGlobalInSubmodule()

    @stampout.region
    def forward(self, x):
        return self.inner(x) * 2


def test_global_read_in_a_submodule_forward_is_guarded():
    a, b = Outer(), Outer()

    def prog(x):
        SETTINGS["shift"] = 1.0
        y = a(x)
        SETTINGS["shift"] = 5.0
        return b(y)

    x = torch.randn(3)
    cap = stampout.capture(prog, x)
    assert cap.stats.traces == 2
    torch.testing.assert_close(cap(x), prog(x))


def test_region_error_for_bad_max_reuse_entries():
    with pytest.raises(stampout.RegionError, match="max_reuse_entries"):
        stampout.region(lambda x: x, max_reuse_entries=0)
