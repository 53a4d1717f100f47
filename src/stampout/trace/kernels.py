"""When an op's kernel cannot take the capture's symbolic sizes: they are specialized (guarded). (Other
failures of a kernel on fakes are reported by op_errors.py.)"""

from __future__ import annotations

from typing import Any

import torch

from ..torch_internals import FakeTensor

# What meta kernels and C++ say when they meet a symbolic size they cannot take.
_SYMBOLIC_LIMITS = (
    "only concrete integers",
    "with symbolic sizes",
    "Cannot call sizes()",
    "Cannot call strides()",
    "Cannot call numel()",
    "Cannot call storage_offset()",
)


def is_symbolic_limit(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, RuntimeError) and any(limit in text for limit in _SYMBOLIC_LIMITS)


def has_symbolic_shape(t: torch.Tensor) -> bool:
    return any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride(), t.storage_offset()))


class Specializer:
    """Static stand-ins for the symbolic values of one op call: sizes as ints, fakes with int shapes (each
    `int()` of a symbol is a guard, so the capture is valid for these sizes only)."""

    def __init__(self, new_fake: Any) -> None:
        self.new_fake = new_fake
        self.memo: dict[int, torch.Tensor] = {}

    def __call__(self, value: Any) -> Any:
        if isinstance(value, torch.SymInt):
            return int(value)
        if isinstance(value, torch.SymFloat):
            return float(value)
        if isinstance(value, torch.SymBool):
            return bool(value)
        if isinstance(value, FakeTensor) and has_symbolic_shape(value):
            hit = self.memo.get(id(value))
            if hit is None:
                hit = self.memo[id(value)] = self.new_fake(
                    tuple(int(s) for s in value.shape), tuple(int(s) for s in value.stride()),
                    int(value.storage_offset()), value.dtype, value.device, value.requires_grad)
            return hit
        return value


__all__ = ["Specializer", "has_symbolic_shape", "is_symbolic_limit"]
