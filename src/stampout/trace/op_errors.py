"""An op that fails on fake tensors during a capture, reported as eager reports it, at the user's line.

A shape bug in the user's model fails in the op's fake (meta) kernel, whose message is not eager's ("a and b must
have same reduction dim" for "mat1 and mat2 shapes cannot be multiplied"), and torch logs ~20 lines of
`fake_tensor.py` traceback first. During a capture that log is dropped, and the op is run once more on
uninitialised real tensors of the same metadata (nothing is computed when the shapes are wrong: kernels check
first), so the error says what eager would. An op without a fake kernel is explained as such.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import config
from ..errors import CaptureError, message
from ..torch_internals import DisableTorchFunction, OpOverload, pytree
from .frames import user_location, user_source_line

_FAKE_LOGGER = logging.getLogger("torch._subclasses.fake_tensor")


class _Skip(Exception):
    pass


class _DuringCapture(logging.Filter):
    """Drops torch's "failed while attempting to run meta" records on threads that are capturing."""

    def __init__(self, capturing: Callable[[], bool]) -> None:
        super().__init__()
        self.capturing = capturing

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.capturing()


@contextlib.contextmanager
def quiet_fake_kernels(capturing: Callable[[], bool]) -> Iterator[None]:
    """While a capture runs: torch's log of failed fake kernels is silenced on the capturing thread (the
    failure becomes a CaptureError that says it all)."""
    log_filter = _DuringCapture(capturing)
    _FAKE_LOGGER.addFilter(log_filter)
    try:
        yield
    finally:
        _FAKE_LOGGER.removeFilter(log_filter)


def _eager_error(func: Callable, args: tuple, kwargs: dict) -> BaseException | None:
    """The error `func` raises on real CPU tensors with the metadata of the fakes in `args`/`kwargs` (None: it
    runs, or cannot be tried: symbolic sizes, another device, too large)."""
    from ..torch_internals import unset_fake_temporarily

    total = 0

    def real(value: Any) -> Any:
        nonlocal total
        if not isinstance(value, torch.Tensor):
            return value
        if value.device.type != "cpu" or not all(type(s) is int for s in (*value.shape, *value.stride())):
            raise _Skip
        total += value.numel() * value.element_size()
        if total > config.replay_max_bytes:
            raise _Skip
        return torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype)

    with unset_fake_temporarily(), DisableTorchFunction():
        try:
            real_args, real_kwargs = pytree.tree_map(real, (args, kwargs))
        except _Skip:
            return None
        try:
            func(*real_args, **real_kwargs)
        except Exception as error:  # noqa: BLE001 - whatever eager raises is what the user should see
            return error
    return None


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return repr(value) if len(repr(value)) < 40 else type(value).__name__


def _op_name(func: Callable) -> str:
    name = getattr(func, "__name__", None) or str(func)
    module = getattr(func, "__module__", "") or ""
    return f"torch.{name}" if module.startswith("torch") and not isinstance(func, OpOverload) else name


def _qualified_name(func: Callable) -> str:
    """`namespace::name` of a torch.ops op (what register_fake takes), else the op's name."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        return schema.name
    return getattr(func, "_qualified_op_name", None) or _op_name(func)


def op_failed(func: Callable, args: tuple, kwargs: dict, error: RuntimeError) -> CaptureError:
    """The CaptureError for `func(*args, **kwargs)` failing on fakes with `error` (to raise from it)."""
    flat = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    inputs = ", ".join(_describe(v) for v in flat[:4]) + (", ..." if len(flat) > 4 else "")
    line = user_source_line(3)
    code = f"\n  code: {line}" if line else ""
    name = _op_name(func)
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if "fake impl" in text or "fake kernel" in text or type(error).__name__ == "UnsupportedOperatorException":
        qualified = _qualified_name(func)
        return CaptureError(message(
            f"the op {qualified} has no fake (meta) kernel: stampout runs the program on fake tensors, which need "
            f"one to know the output's shape (inputs: {inputs})",
            user_location(3),
            f"register one: @torch.library.register_fake(\"{qualified}\") on a function that returns "
            "torch.empty(...) of the output's shape (or the custom op's .register_fake)",
        ))
    eager = _eager_error(func, args, kwargs)
    if eager is not None:
        eager_text = str(eager).strip().splitlines()[0] if str(eager).strip() else type(eager).__name__
        error = CaptureError(message(
            f"{type(eager).__name__} in {name}: {eager_text} (inputs: {inputs}){code}",
            user_location(3),
            "this call fails in eager too: fix the shapes or dtypes at that line",
        ))
        error.eager_too = True  # (a program that catches it takes the path eager takes: frames.swallowed)
        return error
    return CaptureError(message(
        f"{name} failed on fake tensors: {text} (inputs: {inputs}){code}",
        user_location(3),
        "eager accepts these inputs but torch's fake (meta) kernel does not: run that part outside the captured "
        "code, or report the meta kernel to PyTorch",
    ))
