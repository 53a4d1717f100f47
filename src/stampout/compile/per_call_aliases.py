"""Whether a call's tensor inputs and the tensors its graph reads (per call: a KV cache's layers, `box.a`; fixed:
parameters and buffers) share memory as they did at capture: a functionalized graph traced on distinct tensors
is wrong on aliased ones (`model(model.lin.weight.detach())` with a forward that writes its input).

The full answer (structure.aliases_of) looks up the storage of every tensor: 40 us for the 240 cache tensors
of an 80-layer decode step. Between calls those tensors are usually the same, in place: where their sizes
and strides are pinned by the entry's metadata check, their byte ranges are a function of their data
pointers, so the same objects at the same pointers mean the same answer as the last call that passed; the
inputs then only need a storage of their own, apart from the remembered ones.

# Note: pointers alone, when the remembered byte ranges are apart
Where the last call's per-call tensors had non-empty byte ranges that pairwise share no byte, their data pointers
alone decide (no `id` pass): the same pointers with the same sizes, strides and dtype give the same ranges, still
pairwise apart, so distinct objects sharing no memory; and, their storage offsets being checked exactly too, the
same storage starts. (Two storages over one array whose tensors' bytes stay apart may then pass where the full
check, going by whole storages, would refuse: their elements share no byte, so the graph is right on them.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..torch_internals import is_native, tensor_check
from ..trace.memory import Spans, memory_span, spans_of
from ..trace.structure import aliases_of, show_aliases

_data_ptr = torch.Tensor.data_ptr


class PerCallAliases:
    """The aliasing check of one entry: `holds(leaves, per_call)`, remembering the last call that passed.

    `pinned`: every tensor read per call has its sizes, strides and dtype checked exactly on each call (a
    static capture), so the memo may stand on data pointers."""

    __slots__ = ("expected", "pinned", "_memo")

    def __init__(self, expected: tuple, pinned: bool) -> None:
        self.expected = expected
        self.pinned = pinned
        # (whether the tensors are at the same pointers, and the same objects where the pointers alone do not decide;
        # the memory they use; whether that check is the native pass over their metadata and pointers)
        self._memo: tuple[Callable[[tuple], bool], Spans, bool] | None = None

    def remembered(self, per_call: tuple) -> tuple | None:
        """The memo, where it is the native pass (each tensor's class, metadata and data pointer, with the thread's
        dispatch state, as recorded at the last call that held) and `per_call` passes it; else None. That call's
        exact metadata check passed (the entry checks metadata before this check), so every check of those fields
        passes now too (compile/entries.py: the memoized per-call tensors are then not checked twice)."""
        memo = self._memo
        if memo is None or not memo[2]:
            return None
        try:
            return memo if memo[0](per_call) else None
        except (TypeError, RuntimeError):
            return None

    def holds(self, leaves: list[Any], per_call: tuple, inputs: list[torch.Tensor] | None = None,
              input_spans: list | None = None, same_as: tuple | None = None) -> bool:
        """`inputs`, `input_spans`: the call's tensor inputs and their memory_span, where the caller has them;
        `same_as`: the memo `remembered(per_call)` answered with, in this call."""
        if inputs is None:
            inputs = [v for v in leaves[1:] if isinstance(v, torch.Tensor)]
        memo = self._memo if same_as is None else same_as
        if memo is not None:
            try:
                same = same_as is not None or memo[0](per_call)
            except (TypeError, RuntimeError):
                same = False
            if same and self._apart(inputs, memo[1], input_spans):
                return True
        if aliases_of([*inputs, *(v for v in per_call if isinstance(v, torch.Tensor))]) != self.expected:
            return False
        if self.pinned:
            self._remember(inputs, per_call)
        return True

    def why_not(self, leaves: list[Any], labels: list[str], per_call: tuple, read_names: list[str]) -> str | None:
        """Why `holds` refuses this call, the tensors named by `labels` (the inputs') and `read_names`; None
        when it does not."""
        named = [(label, v) for label, v in zip(labels, leaves[1:]) if isinstance(v, torch.Tensor)]
        named += [(label, v) for label, v in zip(read_names, per_call) if isinstance(v, torch.Tensor)]
        actual = aliases_of([v for _, v in named])
        if actual == self.expected:
            return None
        names = [label for label, _ in named]
        return (f"which tensors are the same object or share memory differs: at capture "
                f"{show_aliases(self.expected, names)}, now {show_aliases(actual, names)}")

    @staticmethod
    def _apart(inputs: list[torch.Tensor], taken: Spans, spans: list | None = None) -> bool:
        """Each input in memory of its own, none of it memory the per-call tensors use (`spans`: the inputs'
        memory_span, where known)."""
        # (spans of no memory of their own, None: a fake, an empty or a meta tensor. Sorted by start, two of the
        # non-empty ranges meet exactly when two neighbours do)
        mine = sorted(span for span in (spans if spans is not None else map(memory_span, inputs)) if span is not None)
        end = None
        for span in mine:
            if end is not None and end > span[0] or taken.overlap(span) is not None:
                return False
            end = span[1]
        return True

    def _remember(self, inputs: list[torch.Tensor], per_call: tuple) -> None:
        try:
            pointers = tuple(map(_data_ptr, per_call))
            alone = _ranges_apart(per_call)
        except (TypeError, RuntimeError, NotImplementedError):
            return
        same: Callable[[tuple], bool]
        native = False
        if alone:  # (one native pass over them where there are many: their metadata and pointers, as now)
            same = tensor_check(per_call, lambda: lambda now: tuple(map(_data_ptr, now)) == pointers, self._forget,
                                pointers=True)
            native = is_native(same)
        else:
            pointers = (*map(id, per_call), *pointers)
            same = lambda now: (*map(id, now), *map(_data_ptr, now)) == pointers  # noqa: E731
        taken = spans_of(per_call)
        # (only when the inputs kept apart from the per-call tensors, as `holds` will require of later calls)
        self._memo = (same, taken, native) if self._apart(inputs, taken) else None

    def _forget(self) -> None:
        self._memo = None  # (the native check is built: remembered anew, natively, on the next call that holds)


def _ranges_apart(tensors: tuple) -> bool:
    """Whether each tensor is strided, not empty, and shares no byte with the others, by the byte range from its
    data pointer to its last element's end."""
    ranges = []
    for t in tensors:
        if t.layout is not torch.strided or t.numel() == 0:
            return False
        start = t.data_ptr()
        extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
        ranges.append((start, start + extent * t.element_size()))
    ranges.sort()
    return all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:]))


def overlaps_fixed(inputs: list[Any], fixed: Any, spans: Spans, input_spans: list | None = None) \
        -> tuple[tuple[int, int], ...]:
    """Pairs (input, fixed lifted tensor) whose bytes may overlap: one storage lookup per input (`input_spans`:
    their memory_span, where known), the pairs worked out only for an input whose memory meets the fixed tensors'
    (`spans`)."""
    pairs = []
    for i, (t, span) in enumerate(zip(inputs, input_spans if input_spans is not None else map(memory_span, inputs))):
        if span is not None and spans.overlap(span) is not None:
            fixed_tensors = [(j, f) for j, f in enumerate(fixed) if isinstance(f, torch.Tensor)]
            pairs.extend((i, j) for j, f in fixed_tensors if aliases_of([t, f]) != (0, 1))
    return tuple(pairs)
