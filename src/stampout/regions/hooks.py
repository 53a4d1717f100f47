"""What a region call's trace is shown while it runs: the trace and profile functions that show open frames the
Python code and C calls of the program, and the attribute reads and writes and the other notes (lifts, value
decisions, hooks) that make a frame's trace ineligible or record what it depends on."""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import torch

from ..context import listeners
from ..guards.namespaces import ENVIRON_READS, note_environ_read
from ..sources import Absolute
from ..torch_internals import DisableTorchFunction
from ..trace.code import code_facts, is_user_code
from ..trace.frames import caller_outside_torch, set_profile, user_location
from . import slot_index
from .events import Ineligible
from .frame import RegionFrame
from .purity import (
    IMPORTS_BY_NAME,
    REGISTRY_LOOKUPS,
    impure_call,
    interpreter_state_call,
    location,
    python_setter,
    torch_state_call,
    user_caller,
    watched_file,
)

_NN_MODULES = os.path.dirname(torch.nn.modules.__file__) + os.sep  # nn.GELU.forward reads F.gelu: guarded too


class CallHooks:
    """The trace and profile hooks and the notes that open region frames receive (a part of RegionCalls)."""

    def hooks_set(self) -> bool:
        return sys.gettrace() is self.trace_hook or sys.getprofile() is self.profile_hook

    def note_root_lift(self, t: torch.Tensor) -> None:
        """The outer graph lifted a tensor; a program frame must be able to name it to guard it."""
        program = self.program
        if program is not None and id(t) not in program.sources and not program.leaves_contain(t):
            cache = self.snapshot.cached_by(t)
            if cache is not None:  # a hit: CacheReads guards what the cache holds, so this is the object it held
                name = getattr(cache, "__qualname__", type(cache).__name__)
                program.adopt(t, Absolute(t, f"a result cached by {name}"), where=user_location(4))
                return
            program.mark_ineligible(
                f"uses a tensor of shape {tuple(t.shape)} that is not reachable from the module, its inputs, "
                f"closures or globals (at {user_location(4)})"
            )

    def note_value_decision(self, scope: frozenset[int]) -> None:
        """Python looked at the value of a tensor computed from constants; frames that did not compute it
        themselves depend on a value their guards do not see."""
        for frame in self.frames:
            if id(frame) not in scope:
                frame.mark_ineligible(
                    f"takes a Python decision on the value of a tensor computed outside it (at {user_location(4)})"
                )

    def note_unkept(self, reason: str) -> None:
        """The program does what AOTAutograd backends do not keep: registers an autograd hook (a reused trace
        would register the traced call's function) or sets a tensor's `.data`. A compiled program runs eagerly."""
        for frame in self.frames:
            frame.mark_ineligible(reason)

    def note_unguarded_read(self, reason: str) -> None:
        """The program read state no guard sees (`p.grad`, `x._version`): no open frame's trace is reusable."""
        for frame in self.frames:
            frame.mark_ineligible(reason)

    def note_torch_arguments(self, args: tuple, kwargs: dict) -> None:
        """A torch call's arguments, while a region trace follows per-layer indices: one among them
        (`x.size(layer_idx)`) is used by value (regions/slot_index.py)."""
        slot_index.touch(args)
        slot_index.touch(kwargs)

    def frame_ids(self) -> frozenset[int]:
        return frozenset(id(f) for f in self.frames)

    def start(self) -> None:
        """While frames are open, show the Python code that runs to them and to the world snapshot (a trace
        function) and its C calls to them (a profile function), until `stop`; a tracer or profiler the user
        had set keeps getting its events. (Outside frames nothing is hooked: a stamped layer stays cheap; the
        snapshot notes the program's code before it runs, see Snapshot.note_program.)"""
        self._previous_trace = sys.gettrace()
        self._previous_profile = sys.getprofile()

    def stop(self) -> None:
        self.frames.clear()
        set_profile(self._previous_profile)
        sys.settrace(self._previous_trace)
        self._previous_trace = self._previous_profile = None

    def push(self, frame: RegionFrame) -> None:
        self.frames.append(frame)
        if len(self.frames) == 1:
            sys.settrace(self.trace_hook)
            sys.setprofile(self.profile_hook)

    def pop(self) -> None:
        self.frames.pop()
        if not self.frames:
            set_profile(self._previous_profile)
            sys.settrace(self._previous_trace)

    def _on_c_call(self, frame: types.FrameType, event: str, arg: Any) -> None:
        """A profile function: a C call that is not known pure (`random.random`, `time.time`) makes every open
        frame's trace ineligible (its result would be baked into reused and compiled calls)."""
        previous = self._previous_profile
        if previous is not None and callable(previous):  # (a C profiler, cProfile's, misses the capture's events)
            previous(frame, event, arg)
        if event != "c_call" or not self.frames:
            return
        state = interpreter_state_call(arg)
        if watched_file(frame.f_code.co_filename) or state:
            what = impure_call(arg)
            caller = user_caller(frame, quiet_too=state) if what is not None else None
        else:  # (torch's Python reseeding its generator or setting autograd hooks for the user)
            what = torch_state_call(arg, frame)
            caller = caller_outside_torch(frame) if what is not None else None
        if caller is not None:
            reason = f"calls {what}, which is not known to be pure (at {location(caller)})"
            for f in self.frames:
                if watched_file(frame.f_code.co_filename) or state:
                    f.mark_ineligible(reason)
                else:  # (torch's own Python sets its state: stopping it halfway would leave the state set)
                    f.ineligible.append(Ineligible(reason, location(caller)))

    def _on_call(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        """A trace function (called once per Python call, on this thread only): user code that is about to
        run is shown to every open frame, which guards the globals it may read."""
        previous = self._previous_trace
        local = previous(frame, event, arg) if previous is not None else None
        code = frame.f_code
        if event == "call" and self.frames and self.frames[-1].slots is not None:
            local = self.frames[-1].slots.on_call(frame) or local
        if event == "call" and is_user_code(code):
            g = frame.f_globals
            snapshot = self.snapshot
            if self.frames or not snapshot.saw(code, g):
                with DisableTorchFunction(), listeners(None, None):
                    snapshot.note_code(frame, code_facts(code).names)
                    for f in self.frames:
                        f.on_code(code, g, frame=frame)
        elif event == "call" and self.frames and code.co_filename.startswith(_NN_MODULES):
            g = frame.f_globals
            with DisableTorchFunction(), listeners(None, None):
                for f in self.frames:
                    f.on_library_code(code, g)
        elif (event == "call" and self.frames and code in IMPORTS_BY_NAME
              and watched_file(frame.f_back.f_code.co_filename)):
            for f in self.frames:
                f.mark_ineligible(f"imports a module by name (at {location(frame.f_back)}): what it returns is read "
                                  "from sys.modules, which no guard sees")
        elif (event == "call" and self.frames and code.co_name == "<module>" and code.co_filename.startswith("<")
              and not code.co_filename.startswith("<frozen") and watched_file(frame.f_back.f_code.co_filename)):
            for f in self.frames:  # (eval/exec handed to a C caller, `map(eval, exprs)`: no c_call of them is seen)
                f.mark_ineligible(f"runs code made from a string (eval or exec, at {location(frame.f_back)}): it "
                                  "reads globals no frame watches")
        elif (event == "call" and self.frames and code in REGISTRY_LOOKUPS
              and watched_file(frame.f_back.f_code.co_filename)):
            for f in self.frames:
                f.mark_ineligible(f"calls {code.co_qualname} (at {location(frame.f_back)}): what it returns is held by "
                                  "a process-wide registry, which no guard sees")
        elif event == "call" and self.frames and code in ENVIRON_READS:  # (os.getenv, os.environ.get)
            with DisableTorchFunction(), listeners(None, None):
                for f in self.frames:
                    note_environ_read(f.namespaces, frame, ENVIRON_READS[code])
        elif event == "call" and self.frames:
            what = python_setter(code)
            caller = caller_outside_torch(frame) if what is not None else None
            if caller is not None:  # (recorded, not raised: torch's Python is about to set its state)
                reason = f"calls {what}, which is not known to be pure (at {location(caller)})"
                for f in self.frames:
                    f.ineligible.append(Ineligible(reason, location(caller)))
        return local

    def note_autograd_read(self) -> None:
        """The code being traced read `requires_grad` (or similar): its traces depend on it."""
        for frame in self.frames:
            frame.reads_requires_grad = True

    def on_read(self, obj: Any, name: str, value: Any) -> Any:
        """Every open frame records the read; an int attribute of a module read by the innermost region is
        returned as a SlotIndex when that region can follow its uses (per-layer indices)."""
        profile = sys.getprofile()
        sys.setprofile(None)  # (stampout's own bookkeeping: no C call of it is the program's)
        try:
            with DisableTorchFunction(), listeners(None, None):
                return self._record_read(obj, name, value, sys._getframe(2))
        finally:
            set_profile(profile)

    def _record_read(self, obj: Any, name: str, value: Any, user: types.FrameType) -> Any:
        frames = self.frames
        inner = frames[-1] if frames else None
        slot = None
        if inner is not None and not inner.program:
            if type(value) is int and isinstance(obj, torch.nn.Module):
                slot = inner.slot_read(obj, name, value, user)
            elif type(value) in (list, tuple):
                inner.container_read(obj, name, value, user)
        for frame in frames:
            if frame is not inner or slot is None:
                frame.on_read(obj, name, value)
        return slot

    def on_write(self, obj: Any, name: str, value: Any, old: Any) -> None:
        with DisableTorchFunction(), listeners(None, None):
            for frame in self.frames:
                frame.on_write(obj, name, value, old)
