"""The capture context: the state of one capture, reached through a thread-local.

A capture belongs to the thread that runs it. Region markers, attribute shims and patched torch hooks
look the context up here: on any other thread they find none and behave as plain eager code. Captures
are serialized by `CAPTURE_LOCK` (a few torch module globals must be patched for the duration of a
capture, and those are process-wide); calls of compiled functions that only check guards never take it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

Reader = Callable[[Any, str, Any], Any]  # may return a value the reader gets instead (or None)
Writer = Callable[[Any, str, Any, Any], None]  # (object, name, new value, value before)


class CaptureContext:
    """What one running capture shares with the code it runs: its region handler, attribute listeners, and how
    many per-layer indices (regions.slots) its region traces follow now."""

    __slots__ = ("handler", "tracer", "read", "write", "slots_followed", "raised", "root")

    def __init__(self, handler: Any, tracer: Any) -> None:
        self.handler = handler  # regions.call.RegionCalls: every region call goes there
        self.tracer = tracer  # tracer.Tracer: custom autograd.Function calls go there
        self.read: Reader | None = None  # attribute reads on watched objects (None: not recording)
        self.write: Writer | None = None
        self.slots_followed = 0  # while non-zero the tracer looks for them among torch calls' arguments
        # Every StampoutError made on this thread during the capture (see `swallowed`): a program that catches one
        # (`try: if x.sum() > 0: ... except RuntimeError:`) took, while traced, a path eager would not take.
        self.raised: list[BaseException] = []
        self.root: Any = None  # the frame that runs the program (the user's frames are those below it)


class _State(threading.local):
    ctx: CaptureContext | None = None


STATE = _State()
CAPTURE_LOCK = threading.RLock()


def note_raised(error: BaseException) -> None:
    """(StampoutError.__init__) Remember an error made while this thread captures."""
    ctx = STATE.ctx
    if ctx is not None:
        ctx.raised.append(error)


def current() -> CaptureContext | None:
    """The capture running on this thread, if any."""
    return STATE.ctx


@contextlib.contextmanager
def entered(ctx: CaptureContext) -> Iterator[CaptureContext]:
    """Make `ctx` this thread's capture for the duration of the block."""
    STATE.ctx = ctx
    try:
        yield ctx
    finally:
        STATE.ctx = None


class Listening:
    """The block of `listeners` (a class: cheaper to enter than a generator, and every stamped call enters one)."""

    __slots__ = ("read", "write", "ctx", "saved")

    def __init__(self, read: Reader | None, write: Writer | None) -> None:
        self.read, self.write = read, write

    def __enter__(self) -> None:
        ctx = self.ctx = STATE.ctx
        if ctx is not None:
            self.saved = (ctx.read, ctx.write)
            ctx.read, ctx.write = self.read, self.write

    def __exit__(self, *exc: object) -> None:
        if self.ctx is not None:
            self.ctx.read, self.ctx.write = self.saved


def listeners(read: Reader | None, write: Writer | None) -> Listening:
    """Set this thread's attribute listeners for the block (no-op outside a capture)."""
    return Listening(read, write)
