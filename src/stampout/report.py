"""Reports: region events as text."""

from __future__ import annotations

from typing import Any

from .regions.events import Outcome


def explain_text(cap: Any) -> str:
    """One line per region call (outcome, site, reason on a miss), then the totals."""
    lines = [f"stampout capture: {len(cap.gm.graph.nodes)} nodes in the outer graph; region calls: {cap.stats}"]
    for i, e in enumerate(cap.events):
        line = f"  [{i}] {e.region} at {e.call_site}: {e.outcome} -> {e.subgraph}"
        if e.outcome is not Outcome.REUSED and e.reason:
            line += f"\n      why not reused: {e.reason}"
        if e.ineligible:
            line += f"\n      cannot be reused later: {e.ineligible}"
        lines.append(line)
    if not cap.events:
        lines.append("  (no region calls: mark repeated blocks with @stampout.region)")
    if getattr(cap, "shapes", None) is not None:
        lines.append(f"symbolic sizes; the capture serves every input for which this holds: {cap.shapes.describe()}")
    return "\n".join(lines)
