"""Which real tensors share memory, by the bytes their storages span rather than by storage object: two storages
can cover the same memory (`torch.from_numpy(a.numpy())` beside `a`, `from_numpy` of one array twice,
`torch.frombuffer`), and a graph traced on fakes of them (one fake storage per real storage) takes them as apart.

A fake tensor, a meta tensor and an empty storage have no bytes here: they are told apart by their storage object
alone (structure.aliases_of).
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from ..torch_internals import FakeTensor


def memory_span(t: Any, storage: Any = None) -> tuple[int, int] | None:
    """The bytes `t`'s storage spans, [start, end); None for a tensor without real memory of its own (a fake, a
    meta tensor, an empty storage, a sparse or wrapper tensor)."""
    if isinstance(t, FakeTensor):
        return None
    try:
        storage = t.untyped_storage() if storage is None else storage
        start, size = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None
    return (start, start + size) if start and size else None


class Spans:
    """Disjoint byte ranges, sorted: `overlap(span)` says which one a new range meets (one bisection)."""

    __slots__ = ("starts", "ends", "owners")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.owners: list[Any] = []

    def _met(self, span: tuple[int, int]) -> int | None:
        i = bisect.bisect_right(self.starts, span[0])
        if i and self.ends[i - 1] > span[0]:
            return i - 1
        if i < len(self.starts) and self.starts[i] < span[1]:
            return i
        return None

    def overlap(self, span: tuple[int, int]) -> Any:
        """The owner of a range `span` meets, or None."""
        i = self._met(span)
        return None if i is None else self.owners[i]

    def add(self, span: tuple[int, int], owner: Any) -> None:
        """Add a range, merged with those it meets (under the owner of the first met)."""
        while (i := self._met(span)) is not None:
            span, owner = (min(span[0], self.starts[i]), max(span[1], self.ends[i])), self.owners[i]
            del self.starts[i], self.ends[i], self.owners[i]
        i = bisect.bisect_right(self.starts, span[0])
        self.starts.insert(i, span[0])
        self.ends.insert(i, span[1])
        self.owners.insert(i, owner)


def spans_of(tensors: Any) -> Spans:
    """The memory of `tensors` (a storage shared by several counts once), overlapping ranges merged: what an
    input must keep apart from."""
    spans, seen = Spans(), set()
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        try:
            storage = t.untyped_storage()
            key = storage._cdata
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            continue
        if key in seen:
            continue
        seen.add(key)
        span = memory_span(t, storage)
        if span is not None:
            spans.add(span, t)
    return spans


_resizable = torch.UntypedStorage.resizable


def storages_apart(tensors: list[Any], storages: list[Any]) -> bool:
    """Whether the distinct `storages` of `tensors` (one each) cover disjoint memory (the common case). Storages
    torch allocated (resizable ones) each own their memory: only the others (over a NumPy array, a buffer, shared
    memory) are looked at by their bytes."""
    if all(map(_resizable, storages)):
        return True
    spans = sorted(s for s in map(memory_span, tensors, storages) if s is not None)
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


class CapturedMemory:
    """The real tensors a capture turns into fakes (its inputs, then each tensor it lifts), by their storages'
    memory: a tensor whose storage is another storage over memory an earlier one covers would be faked apart
    from it, so `claim` names the earlier one (the capture refuses).

    Storages torch allocated (resizable ones) each own their memory (as in `storages_apart`): they meet only a
    storage over memory torch did not allocate for it (a NumPy array's, a buffer's, one made over a tensor's
    memory). Until the first such storage, they are only listed (`owned`, in order); it puts them in `spans`,
    as `claim` would have one by one, before it is compared (a stamped layer lifts ten parameters: their spans
    are not computed)."""

    __slots__ = ("spans", "storages", "owned")

    def __init__(self) -> None:
        self.spans = Spans()
        self.storages: dict[int, None] = {}  # storage _cdata of each storage seen
        self.owned: list[tuple[torch.Tensor, Any, Any]] | None = []  # (tensor, storage, name); None once in spans

    def claim(self, t: torch.Tensor, name: Any) -> Any:
        """Note `t` (read by the capture as `name`); the name of an earlier tensor whose distinct storage
        overlaps its memory, or None."""
        try:
            storage = t.untyped_storage()
            key = storage._cdata
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            return None
        if key in self.storages:
            return None
        self.storages[key] = None
        owned = self.owned
        if owned is not None:
            try:
                own = _resizable(storage)
            except (RuntimeError, NotImplementedError, TypeError, AttributeError):
                own = False
            if own:
                owned.append((t, storage, name))
                return None
            self.owned = None
            for earlier, its_storage, its_name in owned:
                span = memory_span(earlier, its_storage)
                if span is not None:
                    self.spans.add(span, its_name)
        span = memory_span(t, storage)
        if span is None:
            return None
        other = self.spans.overlap(span)
        if other is not None:
            return other
        self.spans.add(span, name)
        return None
