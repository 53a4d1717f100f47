"""The value a region trace gets for an `int` attribute it reads (`self.layer_idx`): a `SlotIndex`, an `int` that
notes on its `SlotState` every use other than indexing (a comparison, arithmetic, hashing, printing, a torch
call). regions/slots.py's `SlotTracker` hands them out and follows where they go (see its module docstring).
"""

from __future__ import annotations

from typing import Any

from ..sources import Source
from ..trace.structure import leaves_of


class SlotState:
    """One int attribute a region trace read: its source, and whether anything but indexing used it."""

    __slots__ = ("source", "value", "used", "why", "closed")

    def __init__(self, source: Source, value: int) -> None:
        self.source = source
        self.value = value
        self.used = False
        self.why = ""
        self.closed = False

    def use(self, why: str) -> None:
        if not self.used and not self.closed:
            self.used = True
            self.why = why


class SlotIndex(int):
    """An int read by a region trace whose uses are followed (see the module docstring)."""

    def __new__(cls, value: int, state: SlotState) -> SlotIndex:
        obj = super().__new__(cls, value)
        obj._state = state
        return obj


PLAIN = int.__int__  # the plain int, without the overridden __int__


def _visible(name: str) -> Any:
    base = getattr(int, name)

    def method(self, *args: Any) -> Any:
        self._state.use(name)
        return base(PLAIN(self), *args)

    method.__name__ = name
    return method


for _name in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__bool__", "__add__",
              "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__mod__", "__rmod__", "__floordiv__",
              "__rfloordiv__", "__truediv__", "__rtruediv__", "__pow__", "__rpow__", "__neg__", "__pos__", "__abs__",
              "__int__", "__float__", "__index__", "__str__", "__repr__", "__format__", "__and__", "__rand__",
              "__or__", "__ror__", "__xor__", "__rxor__", "__lshift__", "__rlshift__", "__rshift__", "__rrshift__",
              "__invert__", "__round__", "__trunc__", "__floor__", "__ceil__", "__divmod__", "__rdivmod__",
              "__reduce__", "__reduce_ex__", "__getnewargs__", "__sizeof__", "bit_length", "bit_count",
              "to_bytes", "as_integer_ratio", "conjugate", "__copy__", "__deepcopy__"):
    if hasattr(int, _name):
        setattr(SlotIndex, _name, _visible(_name))


def touch(values: Any) -> None:
    """Slots among a torch call's arguments (`x.size(layer_idx)`) are used by value."""
    for slot in leaves_of(values, SlotIndex):
        slot._state.use("a torch call")
