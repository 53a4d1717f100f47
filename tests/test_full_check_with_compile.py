"""An entry's full guard check is generated when its capture is compiled, not by the first call after a later
capture (or a write to a watched object) moved the epoch: a generate's second call of its prefill and decode
entries used to generate it then (~40 ms each for an 8-layer decoder)."""

from __future__ import annotations

import torch

import stampout
from stampout.compile import entries
from blocks import Block, sample, stack_of


def test_full_check_exists_once_compiled():
    model = stack_of(Block, 3)
    fn = stampout.compile(model.forward, backend="eager", regions="auto", dynamic=False)
    fn(sample(2, 4))
    (entry,) = fn._entries
    assert entry._full is not None


def test_no_guard_generated_by_calls_after_another_capture(monkeypatch):
    model = stack_of(Block, 3)
    fn = stampout.compile(model.forward, backend="eager", regions="auto", dynamic=False)
    short, long = sample(2, 4), sample(5, 4)
    torch.testing.assert_close(fn(short), model(short))
    torch.testing.assert_close(fn(long), model(long))  # a second capture: the first entry's epoch is gone
    assert fn.stats.captures == 2
    generated = []
    original = entries.compile_guards
    monkeypatch.setattr(entries, "compile_guards", lambda *a, **k: generated.append(a) or original(*a, **k))
    for _ in range(2):  # each entry's next call runs its full check (the epoch moved), already generated
        torch.testing.assert_close(fn(short), model(short))
        torch.testing.assert_close(fn(long), model(long))
    assert generated == []
    assert fn.stats.captures == 2
