"""Entering a capture: the capture context, the fake and torch-function modes, and the torch hooks patched while
a capture runs (torch's region placeholder, vmap's mode lookup, `Function.apply`, `is_compiling`), all restored
on exit. One capture at a time per process: the patched hooks are process-wide."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import torch_internals
from .context import CAPTURE_LOCK, CaptureContext, current, entered
from .errors import CaptureError, message
from .frames import user_location
from .op_errors import quiet_fake_kernels
from .regions.call import RegionCalls
from .regions.marker import torch_marked_call
from .torch_internals import get_current_function_mode_stack, is_torch_function_mode_enabled, set_grad_enabled
from .tracer import CaptureMode, Tracer
from .tracking import Watch


def _our_mode_for_vmap(original: Callable) -> Callable:
    """vmap routes its batching calls through a pre-dispatch mode only under export; do it under capture too
    (on the capturing thread only)."""

    def find() -> Any:
        if current() is not None and is_torch_function_mode_enabled():
            for mode in get_current_function_mode_stack():
                if isinstance(mode, CaptureMode):
                    return mode
        return original()

    return find


def _autograd_function_apply(original: Callable) -> Callable:
    """`Function.apply` during a capture: on the capturing thread the call is recorded as one node (its
    custom backward kept), elsewhere it is the original."""

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        ctx = current()
        if ctx is None or not is_torch_function_mode_enabled():
            return original(cls, *args, **kwargs)
        return ctx.tracer.on_autograd_function(cls, original, args, kwargs)

    return apply


def _capturing_here() -> bool:
    """Whether this thread is running a capture's program (what `torch.compiler.is_compiling()` answers)."""
    return current() is not None and is_torch_function_mode_enabled()


@contextlib.contextmanager
def capturing(tracer: Tracer, handler: RegionCalls, watch: Watch) -> Iterator[CaptureContext]:
    """Enter the capture context, the fake and torch-function modes, and patch what capture needs; restore
    all on exit. One capture at a time per process (the patched torch hooks are process-wide)."""
    if current() is not None:
        raise CaptureError(message(
            "stampout.capture (or a stampout.compile'd function) was called while another capture runs",
            user_location(), "call the compiled function or capture from outside the captured code",
        ))
    grad = torch.is_grad_enabled()
    with CAPTURE_LOCK:
        ctx = CaptureContext(handler, tracer)
        try:
            hooks = torch_internals.capture_hooks(torch_marked_call, _our_mode_for_vmap, _autograd_function_apply,
                                                  _capturing_here)
            with hooks, quiet_fake_kernels(lambda: current() is not None), entered(ctx), tracer.fake_mode, tracer.mode:
                handler.start()
                try:
                    yield ctx
                finally:
                    handler.stop()
        finally:
            while handler.frames:
                handler.pop()
            watch.restore()
            set_grad_enabled(grad)
