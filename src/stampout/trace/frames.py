"""Finding the user's frame: the innermost one that belongs to neither stampout nor torch."""

from __future__ import annotations

import contextlib
import os
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from .. import caches
from .code import is_user_file

if TYPE_CHECKING:
    from ..context import CaptureContext

_PACKAGE = os.path.dirname(os.path.abspath(sys.modules[__name__.split(".")[0]].__file__))  # (wherever this file sits)
_OWN_DIRS = (
    _PACKAGE + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)
_PLUMBING = (os.path.abspath(contextlib.__file__),)  # `with` machinery between stampout and the user's line
_TOOLS = os.path.join(_PACKAGE, "tools") + os.sep  # the zoo is user code
_FILE_IS_OWN: dict[str, bool] = caches.register({}, "frames own files")


def _is_own(filename: str) -> bool:
    own = _FILE_IS_OWN.get(filename)
    if own is None:
        own = _FILE_IS_OWN[filename] = (
            filename.startswith(_OWN_DIRS) or filename.startswith("<frozen") or filename in _PLUMBING
        ) and not filename.startswith(_TOOLS)
    return own


def user_frame(skip: int = 1) -> FrameType | None:
    """The innermost frame outside stampout and torch, or None."""
    frame = sys._getframe(skip)
    while frame is not None and _is_own(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def is_stampout_file(filename: str) -> bool:
    """Whether code in `filename` is stampout's own (its tools, the model zoo, are user code)."""
    return filename.startswith(_OWN_DIRS[0]) and not filename.startswith(_TOOLS)


def outside_stampout(skip: int = 1) -> FrameType | None:
    """The innermost frame that is not stampout's (torch's own Python included), or None."""
    frame = sys._getframe(skip)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIRS[0]) and \
            not frame.f_code.co_filename.startswith(_TOOLS):
        frame = frame.f_back
    return frame


def caller_outside_torch(frame: FrameType) -> FrameType | None:
    """The first frame from `frame` outward that is not torch's: the user's frame, or None where it is
    stampout's own (torch's Python called by stampout, as converting a tensor to a fake enters inference mode)."""
    while frame is not None and _is_own(frame.f_code.co_filename):
        if frame.f_code.co_filename.startswith(_OWN_DIRS[0]) and not frame.f_code.co_filename.startswith(_TOOLS):
            return None
        frame = frame.f_back
    return frame


def user_location(skip: int = 2) -> str:
    """`file:line in function` of the user's innermost frame ("<unknown>" if none)."""
    frame = user_frame(skip)
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def user_source_line(skip: int = 2) -> str:
    """The text of the user's current line, for error messages."""
    import linecache

    frame = user_frame(skip)
    if frame is None:
        return ""
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()


def failed_at(error: BaseException) -> str:
    """`file:line in function` of the innermost user frame in `error`'s traceback ("<unknown>" if none)."""
    where = "<unknown>"
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if is_user_file(code.co_filename):
            where = f"{code.co_filename}:{tb.tb_lineno} in {code.co_name}"
        tb = tb.tb_next
    return where


_DISPATCH = frozenset(os.path.join(os.path.dirname(os.path.abspath(__file__)), name)  # where torch calls go to fakes
                      for name in ("tracer.py", "fakes.py", "recording.py"))  # (the tracer and its two parts)


def raised_by_user(error: BaseException) -> bool:
    """Whether `error` is the program's own (`raise ValueError(...)` in a forward, as eager raises it): the innermost
    frame of its traceback is user code, not reached through a torch call on fakes (a user's fake kernel that
    refuses symbolic sizes is not the program's error)."""
    tb = error.__traceback__
    if tb is None:
        return False
    dispatched = False
    while tb.tb_next is not None:
        dispatched = dispatched or tb.tb_frame.f_code.co_filename in _DISPATCH
        tb = tb.tb_next
    return not dispatched and is_user_file(tb.tb_frame.f_code.co_filename)


def symbolic_fault(error: BaseException) -> bool:
    """Whether the program's own error is Python refusing a symbolic size where eager has an int (`divmod(n, 4)`,
    `n.bit_length()`, a user `__index__` returning one): a TypeError or AttributeError naming SymInt, SymFloat or
    SymBool."""
    names = ("SymInt", "SymFloat", "SymBool")
    return isinstance(error, (TypeError, AttributeError)) and any(name in str(error) for name in names)


def set_profile(profile: Any) -> None:
    """`sys.setprofile` of what `sys.getprofile` returned. A C profiler (cProfile's: `sys.getprofile` gives its
    Profiler object, which is not callable) is turned back on by its own `enable()`."""
    if profile is None or callable(profile):
        sys.setprofile(profile)
    else:
        sys.setprofile(None)
        profile.enable()


class HooksOff:
    """The block of `python_hooks_off` (a class: a stamped region call enters one, and a generator-based context
    manager costs it three times as much)."""

    __slots__ = ("trace", "profile")

    def __enter__(self) -> None:
        self.trace, self.profile = sys.gettrace(), sys.getprofile()
        sys.settrace(None)
        sys.setprofile(None)

    def __exit__(self, *exc: object) -> None:
        set_profile(self.profile)
        sys.settrace(self.trace)


def python_hooks_off() -> HooksOff:
    """Run stampout's or torch's own Python without this thread's trace and profile functions (the capture's,
    which watch only user code), and put them back after."""
    return HooksOff()


def swallowed(ctx: CaptureContext | None, since: int = 0, propagating: BaseException | None = None
              ) -> BaseException | None:
    """The first error stampout raised during the capture (after the first `since`) that the program caught and
    did not let propagate: raised (it has a traceback), caught by a frame that is not stampout's own (the
    traceback begins at the frame that caught it), not `propagating` and not an error eager raises too (a shape
    bug, `op_errors.op_failed`). Such a program went on down a path (its `except` branch) that eager would not
    take, so what was traced after it cannot stand for the program; None if there is none."""
    if ctx is None:
        return None
    for error in ctx.raised[since:]:
        tb = error.__traceback__
        if (tb is None or error is propagating or getattr(error, "eager_too", False)
                or is_stampout_file(tb.tb_frame.f_code.co_filename)):
            continue
        return error
    return None
