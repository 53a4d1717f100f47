"""Per-layer indices in one region trace: an int attribute of a module (`self.layer_idx`) the trace may follow
as a SlotIndex instead of a constant, so one trace serves every layer; the SlotTracker (regions/slots.py) decides,
and at the end each followed int is guarded by value (used) or by type.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from ..guards.guard import Kind, const_key, hooks_key
from ..sources import MISSING, Attr, Source
from ..trace.frames import user_location
from .objects import accepted_types
from .slots import SlotTracker


class FrameIndices:
    """The per-layer index part of a RegionFrame: its attributes are set in `_begin_indices`."""

    # the host's (RegionFrame), read here
    program: bool
    sources: dict[int, Source]
    _keep: list[Any]
    _written: set[tuple[int, str]]
    guard: Callable[..., None]

    def _begin_indices(self) -> None:
        self.slots: SlotTracker | None = None  # int attributes this region trace follows (created on first read)

    def slot_read(self, obj: Any, name: str, value: int, user: types.FrameType) -> Any:
        """`obj.name` is an int this trace may follow as a per-layer index: a SlotIndex, or None (read it as a
        constant)."""
        base = self.sources.get(id(obj))
        if base is None or (id(obj), name) in self._written or self.program:
            return None
        d = getattr(obj, "__dict__", None)
        if not isinstance(d, dict) or d.get(name, MISSING) is not value:
            return None
        if self.slots is None:
            self.slots = SlotTracker(self)
        return self.slots.read(Attr(base, name), value, name, user)

    def container_read(self, obj: Any, name: str, value: Any, user: types.FrameType) -> None:
        """A list or tuple attribute read: followed in case a per-layer index picks an item of it."""
        if self.program or self.sources.get(id(obj)) is None:
            return
        if self.slots is None:
            self.slots = SlotTracker(self)
        self.slots.container_read(value, user)

    def rename(self, obj: Any, source: Source) -> None:
        """`obj` was reached as an item chosen by a per-layer index: what the trace reads through it is
        read at `source` on each call (its class guarded there)."""
        self.sources[id(obj)] = source
        self._keep.append(obj)
        self.guard(source, Kind.TYPE, accepted_types(obj), user_location(4))
        if isinstance(obj, torch.nn.Module):
            self.guard(source, Kind.HOOKS, hooks_key(obj), user_location(4))

    def _close_slots(self) -> None:
        if self.slots is None:
            return
        for state in self.slots.close():
            where = f"{state.source.name()} (used by {state.why})" if state.used else ""
            if state.used:
                self.guard(state.source, Kind.CONST, const_key(state.value), where)
            else:
                self.guard(state.source, Kind.TYPE, (int,), where)
