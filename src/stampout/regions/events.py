"""What happens to region calls, as the region handler reports it: one event per call, counts by outcome."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Outcome(enum.StrEnum):
    """What one region call did (a str: `event.outcome == "reused"` holds)."""

    TRACED = "traced"  # its body recorded into a new subgraph
    REUSED = "reused"  # stamped out from a reuse entry, nothing traced
    DEDUPED = "deduped"  # traced, then found identical to an existing subgraph, which is used instead


@dataclass
class RegionStats:
    """Region calls by outcome, and the number of distinct subgraphs."""

    traces: int = 0
    reuses: int = 0
    dedups: int = 0
    subgraphs: int = 0

    def __str__(self) -> str:
        return f"traces={self.traces} reuses={self.reuses} dedups={self.dedups} subgraphs={self.subgraphs}"


@dataclass
class RegionEvent:
    """One region call: which region, where it was called, what happened and, on a miss, why."""

    region: str
    call_site: str
    outcome: Outcome
    reason: str = ""  # why a traced call could not reuse (the first failing check), or why it is ineligible
    subgraph: str = ""
    ineligible: str = ""
