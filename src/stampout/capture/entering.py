"""Entering a capture: the capture context, the fake and torch-function modes, and the torch hooks patched while
a capture runs (torch's region placeholder, vmap's mode lookup, `Function.apply`, `is_compiling`), all restored
on exit. One capture at a time per process: the patched hooks are process-wide."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import torch_internals
from ..context import CAPTURE_LOCK, CaptureContext, current, entered
from ..errors import CaptureError, message
from ..regions.call import RegionCalls
from ..regions.marker import torch_marked_call
from ..torch_internals import (
    get_current_function_mode_stack,
    is_torch_function_mode_enabled,
    pop_saved_tensors_default_hooks,
    push_saved_tensors_default_hooks,
    set_grad_enabled,
    top_saved_tensors_default_hooks,
)
from ..trace.frames import caller_outside_torch, user_location
from ..trace.op_errors import quiet_fake_kernels
from ..trace.tracer import CaptureMode, Tracer
from ..watch.tracking import Watch


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


_SYMBOLIC = ((torch.SymInt, int), (torch.SymFloat, float), (torch.SymBool, bool))


def _as_text(cls: type, concrete: type) -> tuple[Callable, Callable]:
    """`repr` (`str` goes through it) and `format` of a symbolic value for the capture: where the user's Python
    turns one into text (`f"rows={x.shape[0]}"`, `str(x.shape)`, `'{:03d}'.format(n)`, a log line), the text
    is eager's for this call's value, and the capture is specialized to it (`int(n)` guards the symbol, as a
    kernel without symbolic support does: fakes._specialize), so other values capture again. Elsewhere (other
    threads, torch's and stampout's own Python) the symbol's own text."""
    original_repr, original_format = cls.__repr__, cls.__format__

    def from_user() -> bool:  # (stampout's own Python runs under DisableTorchFunction)
        return _capturing_here() and caller_outside_torch(sys._getframe(2)) is not None

    def text(self: Any) -> str:
        return repr(concrete(self)) if from_user() else original_repr(self)

    def formatted(self: Any, spec: str) -> str:
        return format(concrete(self), spec) if from_user() else original_format(self, spec)

    return text, formatted


@contextlib.contextmanager
def _symbolic_text() -> Iterator[None]:
    """Sym types' `__repr__`/`__format__` patched for the capture (see `_as_text`), put back after."""
    saved = [(cls, {name: cls.__dict__.get(name) for name in ("__repr__", "__format__")}) for cls, _ in _SYMBOLIC]
    for cls, concrete in _SYMBOLIC:
        cls.__repr__, cls.__format__ = _as_text(cls, concrete)
    try:
        yield
    finally:
        for cls, methods in saved:
            for name, method in methods.items():
                if method is None:
                    delattr(cls, name)
                else:
                    setattr(cls, name, method)


@contextlib.contextmanager
def _saved_tensor_hooks_set_aside() -> Iterator[None]:
    """This thread's saved-tensor hooks (a caller's `checkpoint` around a compiled child, `save_on_cpu`) set
    aside while the program runs on fakes, put back after: they are for the tensors autograd saves when the
    graph runs, and a checkpoint that counted the fakes' would find its recomputation saving fewer."""
    aside = []
    while (hooks := top_saved_tensors_default_hooks(True)) is not None:
        aside.append(hooks)
        pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        while top_saved_tensors_default_hooks(True) is not None:  # (the program's own, left set by an error)
            pop_saved_tensors_default_hooks()
        for pack, unpack in reversed(aside):
            push_saved_tensors_default_hooks(pack, unpack)


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
        ctx.root = sys._getframe(2)  # (this generator's, contextlib's __enter__, then the one that captures)
        try:
            hooks = torch_internals.capture_hooks(torch_marked_call, _our_mode_for_vmap, _autograd_function_apply,
                                                  _capturing_here)
            with hooks, _symbolic_text(), _saved_tensor_hooks_set_aside(), \
                    quiet_fake_kernels(lambda: current() is not None), entered(ctx), tracer.fake_mode, tracer.mode:
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
