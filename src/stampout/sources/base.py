"""The base of every source: `Source` (a path from a call context to a value, resolved with a memo), the call
contexts sources are resolved against, and MISSING. The kinds of source live in roots.py (where a path
starts) and the package's __init__.py (the steps along it, and the one import point for all of them).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

MISSING = object()  # an attribute, item or cell that is not there
_UNSEEN = object()  # (a source not resolved yet in a memo)


class Place(enum.Enum):
    """How a holder holds a value a capture stores there: the kind in its (holder, key, Place) records."""

    ATTR = "attr"  # attribute `key` (setattr)
    ITEM = "item"  # item `key` of a list or dict (holder[key] = ...)
    MEMBER = "member"  # a member of a set (the key is the member itself)

    def store(self, holder: Any, key: Any, value: Any) -> None:
        """Put `value` at this place of `holder`; a frozen dataclass's field as its own `__init__` sets it."""
        if self is Place.ATTR:
            try:
                setattr(holder, key, value)
            except dataclasses.FrozenInstanceError:
                object.__setattr__(holder, key, value)
        elif self is Place.MEMBER:
            holder.discard(key)
            holder.add(value)
        else:
            holder[key] = value


class Source:
    """A path from a call context to a value. Immutable and hashable."""

    __slots__ = ("_hash",)

    def key(self) -> tuple:
        raise NotImplementedError

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            self._hash = hash(self.key())
            return self._hash

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.key() == self.key()

    def __repr__(self) -> str:
        return self.name()

    def name(self) -> str:
        raise NotImplementedError

    def base(self) -> Source | None:
        return None

    def rebase(self, fn: Callable[[Source], Source | None]) -> Source | None:
        """This path with its root replaced by `fn(root)`; None when `fn` has no answer."""
        raise NotImplementedError

    def resolve(self, ctx: CallContext, memo: dict[Source, Any]) -> Any:
        """The value at this path in `ctx` (MISSING when a step fails), memoized by source."""
        value = memo.get(self, _UNSEEN)  # (not try/except: a miss, the common case per call, raises nothing)
        if value is _UNSEEN:
            value = memo[self] = self._step(ctx, memo)
        return value

    def _step(self, ctx: CallContext, memo: dict[Source, Any]) -> Any:
        raise NotImplementedError

    def operands(self) -> tuple[Source, ...]:
        """Other sources this step reads (their expressions follow the base's in `expr`)."""
        return ()

    def expr(self, base_expr: str) -> str:
        """Python expression for this step, given the expression of its base (for generated guards)."""
        raise NotImplementedError


class CallContext:
    """What sources are resolved against: the flat input leaves of a call and the called function."""

    __slots__ = ("leaves", "fn", "inputs")

    def __init__(self, leaves: list[Any], fn: Callable | None, inputs: tuple[tuple, dict] | None = None) -> None:
        self.leaves = leaves
        self.fn = fn
        self.inputs = inputs  # the call's (args, kwargs): its lists and dicts, which no leaf names


class AnchoredContext(CallContext):
    """A call context whose `Anchor` sources read `anchors` (the objects a passed check started from)."""

    __slots__ = ("anchors",)

    def __init__(self, ctx: CallContext, anchors: tuple) -> None:
        super().__init__(ctx.leaves, ctx.fn, ctx.inputs)
        self.anchors = anchors
