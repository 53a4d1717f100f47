"""What happens to region calls, as the region handler reports it: one event per call, counts by outcome, and
why a trace cannot be reused (`Ineligible` records, counted by reason)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Outcome(enum.StrEnum):
    """What one region call did (a str: `event.outcome == "reused"` holds)."""

    TRACED = "traced"  # its body recorded into a new subgraph
    REUSED = "reused"  # stamped out from a reuse entry, nothing traced
    DEDUPED = "deduped"  # traced, then found identical to an existing subgraph, which is used instead


@dataclass(frozen=True)
class Ineligible:
    """Why a trace cannot be reused (a refusal as a value, as FakeTensor's cache-bypass entries): what its code
    did, and the user's file:line that did it. `str()` is the reason."""

    reason: str
    where: str = ""
    only_while: Any = None  # a Guard (a compiled program's): the reason holds only while it passes

    def __str__(self) -> str:
        return self.reason


@dataclass
class RegionStats:
    """Region calls by outcome, the number of distinct subgraphs, and the traced calls that cannot be reused,
    counted by reason (`ineligible`)."""

    traces: int = 0
    reuses: int = 0
    dedups: int = 0
    subgraphs: int = 0
    ineligible: dict[str, int] = field(default_factory=dict)

    def count_ineligible(self, records: tuple[Ineligible, ...]) -> None:
        for record in records:
            self.ineligible[record.reason] = self.ineligible.get(record.reason, 0) + 1

    def __str__(self) -> str:
        text = f"traces={self.traces} reuses={self.reuses} dedups={self.dedups} subgraphs={self.subgraphs}"
        refused = sum(self.ineligible.values())
        return text + (f" ineligible={refused}" if refused else "")


@dataclass
class RegionEvent:
    """One region call: which region, where it was called, what happened and, on a miss, why."""

    region: str
    call_site: str
    outcome: Outcome
    reason: str = ""  # why a traced call could not reuse (the first failing check)
    subgraph: str = ""
    ineligibility: tuple[Ineligible, ...] = ()  # why its trace cannot be reused by later calls

    @property
    def ineligible(self) -> str:
        """The reasons of `ineligibility`, as one line ("" when the trace can be reused)."""
        return "; ".join(record.reason for record in self.ineligibility)
