"""When an op's kernel cannot run on the capture's fakes: symbolic sizes it cannot take are specialized
(guarded), and an op without a fake kernel is a CaptureError that says how to give it one."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, UnsupportedOperatorException

from .errors import CaptureError, message
from .frames import user_location

# What meta kernels and C++ say when they meet a symbolic size they cannot take.
_SYMBOLIC_LIMITS = (
    "only concrete integers",
    "with symbolic sizes",
    "Cannot call sizes()",
    "Cannot call strides()",
    "Cannot call numel()",
    "Cannot call storage_offset()",
)
_FAKE_LOG = logging.getLogger("torch._subclasses.fake_tensor")


def is_symbolic_limit(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, RuntimeError) and any(limit in text for limit in _SYMBOLIC_LIMITS)


def has_symbolic_shape(t: torch.Tensor) -> bool:
    return any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride(), t.storage_offset()))


@contextlib.contextmanager
def quiet_fake_logs() -> Iterator[None]:
    """Silence fake_tensor's `failed while attempting to run meta` traceback (stampout handles the error)."""
    disabled = _FAKE_LOG.disabled
    _FAKE_LOG.disabled = True
    try:
        yield
    finally:
        _FAKE_LOG.disabled = disabled


def op_name(func: Any) -> str:
    schema = getattr(func, "_schema", None)
    if schema is not None:
        return schema.name
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def missing_fake_kernel(func: Any, error: BaseException) -> CaptureError | None:
    """A CaptureError naming the op when `error` says it has no fake (meta) kernel, else None."""
    if isinstance(error, UnsupportedOperatorException):
        name = str(error).strip() or op_name(func)
    elif isinstance(error, RuntimeError) and "no fake impl registered" in str(error):
        name = op_name(func)
    else:
        return None
    name = name.replace(".default", "").replace(".", "::", 1) if "::" not in name else name
    return CaptureError(message(
        f"the op {name} has no fake (meta) kernel, so capture cannot compute the shape of its result",
        user_location(),
        f'register one: @torch.library.register_fake("{name}") def _(x, ...): return torch.empty_like(x) '
        "(or `.register_fake` on a torch.library.custom_op)",
    ))


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


__all__ = ["Specializer", "has_symbolic_shape", "is_symbolic_limit", "missing_fake_kernel",
           "quiet_fake_logs"]
