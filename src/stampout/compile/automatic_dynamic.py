"""Automatic dynamic shapes (torch.compile's `automatic_dynamic_shapes`): per input structure, what the last
capture saw, so the next capture with that structure makes symbolic what was seen to change.

What it keeps, per structure (a call's fingerprint without sizes): the sizes of the call's tensors (`Arg` sources)
and of the tensors the capture lifted (a KV cache's layers), by source; the int attributes it read as constants
(a cache layer's position); and which dims and ints were seen to change since (they stay symbolic from then on).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..guards.guard import Kind
from ..sources import Arg, Attr, CallContext, Source
from ..torch_internals import DisableTorchFunction

log = logging.getLogger("stampout.guards")


class AutomaticDynamic:
    """What one compiled function's captures saw, per input structure, and what changed since."""

    def __init__(self, name: str, enabled: bool) -> None:
        self.name = name  # the compiled function's, for the log
        self.enabled = enabled  # False: dynamic=False, a capture per shape
        self.seen_sizes: dict[tuple, dict[Source, tuple[int, ...]]] = {}
        self.changed_dims: dict[tuple, dict[Source, set[int]]] = {}
        self.seen_ints: dict[tuple, dict[Source, int]] = {}
        self.changed_ints: dict[tuple, set[Source]] = {}

    def dims(self, structure: tuple, ctx: CallContext) -> dict[Source, set[int]]:
        """The dims that changed since the last capture with this input structure, of the call's tensors
        (`Arg` sources) and of the tensors it read through the inputs' objects or the module (a KV cache growing
        by a token per call) — torch.compile's automatic dynamic shapes. They stay symbolic in later captures.
        (With dynamic=True held tensors are found by a capture, so they too become symbolic at a first change.)"""
        if not self.enabled:
            return {}
        dims = self.changed_dims.setdefault(structure, {})
        memo: dict[Source, Any] = {}
        with DisableTorchFunction():
            for source, old in self.seen_sizes.get(structure, {}).items():
                value = source.resolve(ctx, memo)
                if not isinstance(value, torch.Tensor) or value.dim() != len(old):
                    continue
                changed = {d for d, (a, b) in enumerate(zip(old, value.shape)) if a != b} - dims.get(source, set())
                if changed:
                    dims.setdefault(source, set()).update(changed)
                    log.info("%s: %s changed size in dim %s (%s -> %s): capturing it with symbolic sizes",
                             self.name, source.name(), sorted(changed), list(old), list(value.shape))
        return dims

    def ints(self, structure: tuple, ctx: CallContext) -> set[Source]:
        """Int attributes whose value the last capture with this input structure read and that changed since
        (a call counter, a cache layer's position): captured as symbols from now on."""
        if not self.enabled:
            return set()
        changed = self.changed_ints.setdefault(structure, set())
        memo: dict[Source, Any] = {}
        with DisableTorchFunction():
            for source, old in self.seen_ints.get(structure, {}).items():
                value = source.resolve(ctx, memo)
                if type(value) is int and value != old and source not in changed:
                    changed.add(source)
                    log.info("%s: %s changed (%d -> %d): capturing it as a symbolic int", self.name,
                             source.name(), old, value)
        return changed

    def remember(self, structure: tuple, leaves: list[Any], labels: list[str], cap: Any) -> None:
        """What a capture (a Capture) of a call with these flat input leaves saw, for the next capture with the
        same input structure to compare with."""
        sizes: dict[Source, tuple[int, ...]] = {Arg(i + 1, labels[i]): tuple(leaf.shape)
                                                for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
        sizes.update({source: tuple(t.shape) for t, source in cap.lifted
                      if source is not None and isinstance(t, torch.Tensor)})
        self.seen_sizes[structure] = sizes
        self.seen_ints[structure] = {g.source: g.expected[1] for g in cap.program.guards
                                     if g.kind is Kind.CONST and g.expected[0] is int and isinstance(g.source, Attr)}
