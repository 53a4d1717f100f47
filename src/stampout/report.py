"""Reports: region events, refusals and generated guard code as text."""

from __future__ import annotations

import re
from typing import Any

from .guards.guard import DEFERRED_LINE, compile_guards
from .regions.events import Outcome


def explain_text(cap: Any, guards: bool = True) -> str:
    """One line per region call (outcome, site, reason on a miss), the totals, the refusals counted by reason,
    then (`guards`) the generated guard code."""
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
    lines.extend(ineligible_lines(cap))
    if not guards:
        return "\n".join(lines)
    lines.append("guard code:")
    lines.extend("  " + line if line else "" for line in guard_code_text(cap).splitlines())
    return "\n".join(lines)


def ineligible_lines(cap: Any) -> list[str]:
    """The traces that cannot be reused, by reason: how many region calls, and where the first one did it."""
    if not cap.stats.ineligible:
        return []
    first: dict[str, str] = {}
    for e in cap.events:
        for record in e.ineligibility:
            first.setdefault(record.reason, record.where)
    lines = [f"ineligible for reuse ({sum(cap.stats.ineligible.values())} region calls, by reason):"]
    for reason, count in cap.stats.ineligible.items():
        lines.append(f"  {count}x {reason}" + (f" (first at {first[reason]})" if first.get(reason) else ""))
    return lines


def guard_code_text(cap: Any) -> str:
    """The generated predicates of a capture's reuse entries and, for a compiled capture, of its program."""
    parts = []
    for entry in cap.reuse_entries:
        if entry.check is not None:
            parts.append(f"# region {entry.region} -> {entry.subgraph} (traced at {entry.call_site})\n"
                         + annotated(getattr(entry.check, "per_call", entry.check)) + _shared_text(entry.check))
    if cap.program is not None:
        parts.append("# the whole program (stampout.compile): what it read\n"
                     + annotated(compile_guards(cap.program.guards)))
    return "\n\n".join(parts) if parts else "# no guard predicates: no region call of this capture can be stamped out"


def explain_compiled(fn: Any, entries: tuple, pieces: list[str]) -> str:
    """What a compiled function did: its entries (those that run eagerly, and why), `pieces` (compile.stats'
    lines on its piecewise children), its last capture's report, and the guard code of the entry that ran last."""
    name = getattr(fn.fn, "__qualname__", type(fn.fn).__name__)
    lines = [f"stampout.compile of {name}: {fn.stats.captures} captures, {len(entries)} entries"]
    for i, entry in enumerate(entries):
        if entry.capture is None:
            lines.append(f"  [{i}] runs eagerly: {entry.reason}{entry.pieces.describe_glue() if entry.pieces else ''}")
        else:
            last = "  (ran last)" if entry.capture is fn.last_capture else ""
            lines.append(f"  [{i}] compiled: {entry.capture.stats}{last}")
    lines.extend(pieces)
    for brk in fn.breaks:
        lines.append(f"  {brk.describe()}")
    if fn.last_capture is None:
        lines.append("(no compiled call yet)")
        return "\n".join(lines)
    lines.append("last capture:")
    lines.extend("  " + line for line in explain_text(fn.last_capture, guards=False).splitlines())
    lines.append("guard code of the entry that ran last:")
    lines.extend("  " + line if line else "" for line in fn.guard_code().splitlines())
    return "\n".join(lines)


def entry_guard_code(cap: Any, entries: tuple) -> str:
    """The guard predicates of the compiled entry of `cap` (see `Entry.guard_code`)."""
    for entry in entries:
        if entry.capture is not None and entry.capture is cap:
            return entry.guard_code()
    return "# no compiled entry: the function has not run a compiled call (or its entry was dropped)"


def _shared_text(check: Any) -> str:
    """An `entry_guards.EntryCheck`'s guards shared by every call of the entry, as the function `shared`."""
    shared = getattr(check, "shared", None)
    if shared is None:
        return ""
    text = annotated(shared).replace("def check(", "def shared(", 1)
    first, rest = text.split("\n", 1)
    return f"\n{first}  # once per entry, and again after a write to a dict these read\n{rest}"


_ASSIGN = re.compile(r"^ {4}(?: {4})?(v\d+) = (?!_MISSING$)")  # (an inline read: `try:` then the assignment)


def annotated(check: Any) -> str:
    """A generated predicate's source with a comment per line: the source each variable holds, and what each
    test checks (the guard's kind, source and expected value) — the predicate as a user reads it."""
    names = {var: source for source, var in check.variables.items()}
    guards = iter(check.guards)
    lines = []
    for line in check.source_code.splitlines():
        assign = _ASSIGN.match(line)
        if assign and assign.group(1) in names:
            line += f"  # {names[assign.group(1)].name()}"
        elif line.startswith("    if ") or line == DEFERRED_LINE:
            guard = next(guards)
            line += f"  # {guard.kind.value} of {guard.source.name()}: {guard.expected_text()}"
            if line.startswith(DEFERRED_LINE):
                line += " (checked with the others in one C++ call after this function)"
        lines.append(line)
    return "\n".join(lines)
