"""The functions of a higher-order op (`torch.cond`'s branches, a `while_loop` body) run as a frame of their own, so
that a Python side effect they make is seen: eager `torch.cond` (Dynamo, fullgraph) refuses one, so must we."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..context import listeners
from ..errors import CaptureError, message
from ..sources import Absolute
from ..torch_internals import DisableTorchFunction
from ..trace.code import is_user_code
from ..trace.frames import user_location
from .frame import RegionFrame
from .frame_writes import undo

_IMPURE = "not known to be pure"  # (the reason hooks.py gives a C call that may change the world)


class BranchFrames:
    """Runs a higher-order op's function under a frame (a part of RegionCalls)."""

    def run_branch(self, fn: Callable, inputs: list[Any], op: str) -> Any:
        """`fn(*inputs)`, refused where it changes Python state from outside it (attributes, containers, module
        globals) or calls what is not known to be pure (`print`, `random.random`)."""
        users = _user_functions(fn)
        with DisableTorchFunction():
            frame = RegionFrame(users[0] if users else _nothing, inputs, [f"args[{i}]" for i in range(len(inputs))],
                                self.watch)
            for user in users[1:]:
                frame.adopt_function(user, Absolute(user, user.__qualname__))
            if isinstance(fn, torch.nn.Module):  # (what its forward stores on it is seen)
                frame.adopt(fn, Absolute(fn, type(fn).__name__))
            frame.world_state = self.snapshot.state()
        self.push(frame)
        try:
            with listeners(self.on_read, self.on_write):
                out = fn(*inputs)
        finally:
            self.pop()
        with DisableTorchFunction():
            frame.close()
            effects = [*frame.writes, *self.snapshot.changed_since(frame.world_state),
                       *(r.reason for r in frame.ineligible if _IMPURE in r.reason)]
        if effects:
            with DisableTorchFunction(), listeners(None, None):
                undo(frame)  # (eager's torch.cond runs none of the branch's Python: leave the world as it does)
            raise CaptureError(message(
                f"a function of {op} has a Python side effect: {effects[0]}; eager {op} refuses it too "
                "(UncapturedHigherOrderOpError)", user_location(),
                f"keep the functions of {op} pure: return the values instead of storing them"))
        return out


def _nothing() -> None:
    pass


def _user_functions(fn: Any, depth: int = 3) -> list[Any]:
    """`fn` if it is the user's, else the user's functions torch's wrapper closes over (`while_loop` flattens the
    user's body's pytrees in a closure of its own): the frame reads their cells and globals, not torch's."""
    if isinstance(fn, torch.nn.Module):  # (a module as a branch: its forward runs)
        fn = fn.forward
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    if is_user_code(code):
        return [fn]
    found: list[Any] = []
    for cell in (getattr(fn, "__closure__", None) or ()) if depth else ():
        try:
            found.extend(_user_functions(cell.cell_contents, depth - 1))
        except ValueError:  # (an empty cell)
            continue
    return found
