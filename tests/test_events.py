"""Region events: outcomes are an enum that still compares and prints as its word."""

from __future__ import annotations

import torch
from torch import nn

import stampout
from stampout.regions.events import Outcome


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @stampout.region
    def forward(self, x):
        return self.lin(x).relu()


def test_outcomes_are_enum_members_equal_to_their_words():
    cap = stampout.capture(nn.Sequential(Block(), Block()), torch.randn(2, 4))
    assert [e.outcome for e in cap.events] == [Outcome.TRACED, Outcome.REUSED]
    assert [e.outcome for e in cap.events] == ["traced", "reused"]
    assert f"{cap.events[1].outcome}" == "reused" and "Block.forward at" in cap.explain()
    assert isinstance(cap.events[0], stampout.RegionEvent) and str(cap.stats) == (
        "traces=1 reuses=1 dedups=0 subgraphs=1")
