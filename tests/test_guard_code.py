"""Guards you can print: `guard_code()` on captures and compiled functions, and refusals to reuse as counted
`Ineligible` records that `stats` and `explain()` report."""

from __future__ import annotations

import random
import re

import torch
from torch import nn

import stampout
from stampout.regions.events import Ineligible


class Block(nn.Module):
    def __init__(self, scale: float = 0.5) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = scale

    @stampout.region
    def forward(self, x):
        return torch.relu(self.lin(x)) * self.scale + x


class Noisy(nn.Module):
    @stampout.region
    def forward(self, x):
        return x * random.random()  # NOISY_LINE


def _without_comments(code: str) -> str:
    return "\n".join(re.sub(r"  # .*$", "", line) for line in code.splitlines())


def test_capture_guard_code_is_each_reuse_entry_predicate():
    cap = stampout.capture(nn.Sequential(Block(), Block(), Block(0.25)), torch.randn(2, 4))
    assert (cap.stats.traces, cap.stats.reuses) == (2, 1)
    code = cap.guard_code()
    assert code.count("# region Block.forward -> subgraph_") == 2  # one per entry (scale 0.5, scale 0.25)
    assert "# constant of self.scale: 0.5" in code and "# constant of self.scale: 0.25" in code
    # The printout is the predicate that runs, with comments added.
    printed = [_without_comments(part.split("\n", 1)[1]) for part in code.split("\n\n")]
    assert printed == [e.check.source_code for e in cap.reuse_entries]


def test_printed_guard_code_runs_as_the_predicate():
    cap = stampout.capture(nn.Sequential(Block(), Block()), torch.randn(2, 4))
    (entry,) = cap.reuse_entries
    namespace = dict(entry.check.__globals__)
    exec(compile(cap.guard_code(), "<printed>", "exec"), namespace)  # comments and all: valid Python
    assert namespace["check"].__code__.co_code == entry.check.__code__.co_code


def test_capture_without_regions_says_there_are_no_predicates():
    cap = stampout.capture(lambda x: x + 1, torch.randn(2))
    assert cap.guard_code().startswith("# no guard predicates")
    assert "guard code:" in cap.explain()


def test_explain_shows_the_guard_code():
    cap = stampout.capture(nn.Sequential(Block(), Block()), torch.randn(2, 4))
    report = cap.explain()
    assert "guard code:" in report
    assert "# constant of self.scale: 0.5" in report


def test_ineligible_calls_are_counted_records_with_the_users_line():
    cap = stampout.capture(nn.Sequential(Noisy(), Noisy(), Block()), torch.randn(2, 4))
    noisy = [e for e in cap.events if e.region == "Noisy.forward"]
    assert [e.outcome for e in noisy] == ["traced", "traced"]
    for event in noisy:
        (record,) = event.ineligibility
        assert isinstance(record, Ineligible)
        assert "not known to be pure" in record.reason and event.ineligible == record.reason
        line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if "# NOISY_LINE" in text)
        assert record.where.startswith(f"{__file__}:{line} ")
    (reason,) = cap.stats.ineligible
    assert cap.stats.ineligible == {reason: 2}
    assert "ineligible=2" in str(cap.stats)
    report = cap.explain()
    assert f"ineligible for reuse (2 region calls, by reason):\n  2x {reason}" in report
    assert len(cap.reuse_entries) == 1  # the Block's: Noisy's traces made none


def test_eligible_capture_counts_no_refusals():
    cap = stampout.capture(nn.Sequential(Block(), Block()), torch.randn(2, 4))
    assert cap.stats.ineligible == {}
    assert str(cap.stats) == "traces=1 reuses=1 dedups=0 subgraphs=1"
    assert "ineligible" not in cap.explain()


def test_compiled_function_guard_code_is_the_entry_that_ran_last():
    model = nn.Sequential(Block(), Block())
    fn = stampout.compile(model, backend="eager")
    assert fn.guard_code().startswith("# no compiled entry")
    fn(torch.randn(2, 4))
    code = fn.guard_code()
    assert code.startswith("# the full check: after a write to a watched object\ndef check(")
    assert "\n\n# every call (then one C++ check of the metadata of the tensors it read)\ndef check(" in code
    assert "# constant of self[0].scale: 0.5" in code
    first = fn.last_capture
    fn(torch.randn(3, 4))  # a new capture: its entry ran last
    assert fn.stats.captures == 2 and fn.last_capture is not first
    assert fn.guard_code() == fn._compiled._entries[-1].guard_code()
    fn(torch.randn(2, 4))
    assert fn.last_capture is first and fn.guard_code() == fn._compiled._entries[0].guard_code()


def test_compiled_module_passes_guard_code_and_explain_through():
    fast = stampout.compile(nn.Sequential(Block(), Block()), backend="eager")
    fast(torch.randn(2, 4))
    assert fast.guard_code() == fast._compiled.guard_code()
    report = fast.explain()
    assert report.startswith("stampout.compile of Sequential: 1 captures, 1 entries")
    assert "[0] compiled: traces=1 reuses=1 dedups=0 subgraphs=1  (ran last)" in report
    assert "guard code of the entry that ran last:" in report and "# the full check" in report


def test_compiled_explain_says_why_an_entry_runs_eagerly():
    def program(x):
        return x * random.random()

    fn = stampout.compile(program, backend="eager")
    fn(torch.randn(2))
    report = fn.explain()
    assert "[0] runs eagerly: stampout cannot guard it: it calls random.Random.random" in report
    assert "(no compiled call yet)" in report


def test_equal_predicate_sources_share_one_code_object_not_their_constants():
    """Two compiled functions of equal modules generate the same predicate source: it is compiled once (the entries
    of a stack's sharded blocks), while each predicate checks its own expected values."""
    from stampout.guards.guard import _code_of

    torch.manual_seed(0)
    first, second = Block(0.5), Block(0.5)
    a, c = stampout.compile(first, backend="eager"), stampout.compile(second, backend="eager")
    x = torch.randn(2, 4)
    a(x)
    hits = _code_of.cache_info().hits
    c(x)
    ea, ec = a._compiled._entries[0], c._compiled._entries[0]
    assert ec.always.__code__ is ea.always.__code__ and ec.always is not ea.always
    assert _code_of.cache_info().hits > hits
    second.scale = 0.25  # (c's predicates expect 0.5 of its own module; a's module is unchanged)
    torch.testing.assert_close(c(x), second(x))
    torch.testing.assert_close(a(x), first(x))
    assert (a.stats.captures, c.stats.captures) == (1, 2)
