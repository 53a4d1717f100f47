"""What a compiled function did so far, counted over it and the children compiled on their own (its pieces).

A module whose own code runs eagerly (the root of an FSDP2 stack, a model with an uncapturable part) does its
work through its pieces: its `stats` and `last_capture` are theirs, so a caller sees the captures, region traces
and reuses, and the graph that ran last, without walking `pieces`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class CompileStats:
    """Whole-program captures so far, and region traces and reuses over all of them (pieces included)."""

    captures: int = 0
    traces: int = 0
    reuses: int = 0


def total_stats(fn: Any) -> CompileStats:
    """`fn`'s own counts plus those of its pieces, theirs included."""
    out, stack = CompileStats(), [fn]
    while stack:
        f = stack.pop()
        own = f._counts
        out.captures += own.captures
        out.traces += own.traces
        out.reuses += own.reuses
        stack.extend(f.pieces.values())
    return out


def compiled_family(fn: Any) -> list[Any]:
    """`fn` and its pieces, theirs included, root first (pieces in path order)."""
    out, stack = [], [fn]
    while stack:
        f = stack.pop(0)
        out.append(f)
        stack.extend(f.pieces[p] for p in sorted(f.pieces))
    return out


def family_entries(fn: Any) -> tuple:
    """The compiled entries of `fn` and of its pieces (where the capture that ran last is found)."""
    return tuple(entry for f in compiled_family(fn) for entry in f._entries)


def describe_pieces(fn: Any) -> list[str]:
    """A line per piece of `fn` (theirs included): its path and what each of its entries does (a sharded block
    running a sibling's compiled entry says whose: sharded_twins.py)."""
    lines, owners = [], {}
    for piece in compiled_family(fn)[1:]:
        parts = []
        for entry in piece._entries:
            cap = entry.capture
            if cap is None:
                parts.append("runs eagerly" + (entry.pieces.describe_glue() if entry.pieces is not None else ""))
            elif id(cap) in owners:
                parts.append(f"runs the compiled entry of {owners[id(cap)]}")
            else:
                owners[id(cap)] = piece.path
                parts.append(f"compiled: {cap.stats}")
        lines.append(f"  piece {piece.path}: " + ", ".join(parts))
    return lines
