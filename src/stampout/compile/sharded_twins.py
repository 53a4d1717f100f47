"""Sharded blocks of a stack compiled once: a block's piece takes a sibling's compiled entry when its guards
admit the block, instead of capturing it again.

# Note: why a sibling's entry may serve
Each `fully_shard`ed block of a stack is compiled on its own (piecewise.py: the root's code runs eagerly), so
without this each block's first call was a capture of its own — a whole-program capture around one region call,
stamped out from the first block's region entry, then an entry, guards and a (memoized) compile: about 5 ms of
CPU and a thousand long-lived objects per block at the first step. The capture of block 0 is a program of
`self` (the block) and its arguments: its guards and lifted inputs are sources relative to them
(`self.attn.q.weight`), never the block's identity, and its frame function is the class's forward, which
every block of that class shares. So an entry built from block 0's capture with block k's call context, whose
full guard check passes on block k, is what capturing block k would make — as a region call of block k is
stamped out from block 0's region entry. Only sharded siblings of the same class are tried; a failed check
captures as before.
"""

from __future__ import annotations

from typing import Any

from ..regions.fingerprint import without_sizes
from ..sources import CallContext
from .entries import CallKey, Entry


def twin_entry(fn: Any, args: tuple, kwargs: dict, key: CallKey, ctx: CallContext) -> tuple[Entry, Any] | None:
    """For a sharded piece `fn`: an entry of a sibling piece's capture that admits this call, added to `fn` and
    counted as a region reuse, with the call's lifted inputs; None when none does (then `fn` captures)."""
    if not fn._sharded or len(fn._lineage) < 2:
        return None
    parent = fn._lineage[1]
    for sibling in parent.pieces.values():
        if sibling is fn or not sibling._sharded or type(sibling.fn) is not type(fn.fn):
            continue
        for theirs in sibling._entries:
            if theirs.capture is None or theirs.key is None or theirs.key_for(key, ctx.leaves[1:]) != theirs.key:
                continue
            entry = Entry(theirs.capture, theirs.compiled, key, ctx, fn._watch, like=theirs)
            lifted = entry.admits(ctx)  # (no state yet: the full guard check runs first)
            if lifted is None:
                fn._watch.release()  # (what that entry watched; the capture that follows watches its own)
                continue
            fn._add(entry)
            fn._counts.reuses += 1
            fn._remember(CallKey(without_sizes(key.fingerprint, ctx.leaves[1:]), key.requires_grad), args, kwargs,
                         theirs.capture)
            return entry, lifted
    return None
