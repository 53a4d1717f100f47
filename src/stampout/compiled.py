"""stampout.compile: capture and compile on the first call; later calls check guards, then run.

Per call: the input fingerprint and global state; guards that nothing can invalidate behind our back
(globals, closures, objects we cannot watch) as one generated function; the metadata of every parameter
and buffer the program read in one C++ check. Everything else the capture read (module attributes,
`training` flags, which parameter objects are where, hooks) is re-checked only after a write to a watched
object bumped the epoch (see tracking.WriteWatch). A failed guard recaptures, reusing the region cache.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._dynamo.guards import TensorGuards

from .api import _frame_function, capture_program
from .backends import resolve
from .capture import Capture
from .errors import BackendError, GuardError, StampoutError, message
from .frames import user_location
from .guards import Guard, Kind, compile_guards, first_failure
from .regions.auto import auto_regions
from .regions.cache import RegionCache
from .regions.fingerprint import describe_difference, fingerprint, requires_grad_pattern
from .sources import MISSING, Arg, Attr, CallContext, Source
from .structure import build, flatten_inputs
from .tracking import EPOCH, WriteWatch, install_registration_hooks

log = logging.getLogger("stampout.guards")
_LIVE: weakref.WeakSet = weakref.WeakSet()


@dataclass
class CompileStats:
    """Whole-program captures so far, and region traces over all of them."""

    captures: int = 0
    traces: int = 0


def _path(source: Source) -> list[Source]:
    out = [source]
    while (parent := out[-1].base()) is not None:
        out.append(parent)
    return out[::-1]


def protected(guard: Guard, ctx: CallContext, memo: dict, watch: WriteWatch) -> bool:
    """Whether a write to a watched object is the only way this guard's value can change (watching the
    objects on its path as a side effect)."""
    path = _path(guard.source)
    if not (isinstance(path[0], Arg) and path[0].index == 0):
        return False  # globals, closures, per-call input objects: checked on every call
    if guard.kind is Kind.HOOKS and guard.expected != ((), (), (), ()):
        return False  # hooks registered before compile may be removed through old handles
    for source in path[:-1]:
        if source.base() is not None and not isinstance(source, Attr):
            return False  # an item of a container: containers are not watched
        obj = source.resolve(ctx, memo)
        if obj is MISSING or not watch.watch(obj):
            return False
    return True


class _Entry:
    """One capture and its compiled callable, with the guards that say when it may run."""

    def __init__(self, cap: Capture, compiled: Callable, key: tuple, ctx: CallContext, watch: WriteWatch):
        self.capture = cap
        self.compiled = compiled
        self.key = key
        guards = cap.program.guards
        self._full: Callable | None = None  # generated on first need: thousands of guards for a deep model
        always: list[Guard] = []
        tensors: list[Guard] = []
        memo: dict[Source, Any] = {}
        with torch._C.DisableTorchFunction():
            for guard in guards:
                if not protected(guard, ctx, memo, watch):
                    always.append(guard)
                elif guard.kind is Kind.TENSOR:
                    tensors.append(guard)
        self.always = compile_guards(always)
        self.tensor_sources = [g.source for g in tensors]
        self.epoch = -1
        self.tensors: list[torch.Tensor] = []
        self.lifted: list[torch.Tensor] = []
        self.tensor_guard: TensorGuards | None = None

    def refresh(self, ctx: CallContext) -> None:
        """After a full check passed: the current parameter objects, and a C++ check of their metadata."""
        memo: dict[Source, Any] = {}
        with torch._C.DisableTorchFunction():
            tensors = [s.resolve(ctx, memo) for s in self.tensor_sources]
            lifted = self.capture.placeholders_for_lifted()
        # One entry per tensor object: tied weights (lm_head.weight is wte.weight) reach it by two paths,
        # and TensorGuards rejects a tensor listed twice. Which paths lead to which object is guarded by
        # the full check, after any write that could change it.
        names = {id(t): s.name() for s, t in zip(reversed(self.tensor_sources), reversed(tensors))}
        self.tensors = list({id(t): t for t in [*tensors, *lifted]}.values())
        self.tensor_names = [names.get(id(t), "a lifted tensor") for t in self.tensors]
        self.lifted = lifted
        tensors = self.tensors
        self.tensor_guard = TensorGuards(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        )
        self.epoch = EPOCH.value

    def admits(self, ctx: CallContext) -> bool:
        if not self.always(ctx.leaves, ctx.fn):
            return False
        if self.epoch != EPOCH.value:
            if self._full is None:
                self._full = compile_guards(self.capture.program.guards)
            with torch._C.DisableTorchFunction():
                if not self._full(ctx.leaves, ctx.fn):
                    return False
            self.refresh(ctx)
        return self.tensor_guard.check(*self.tensors)

    def why_not(self, ctx: CallContext, key: tuple, labels: list[str]) -> str:
        if key != self.key:
            if key[0] != self.key[0]:
                return "inputs: " + describe_difference(self.key[0], key[0], labels)
            return "which inputs require grad differs"
        failure = first_failure(self.capture.program.guards, ctx)
        if failure is not None:
            _, guard, actual = failure
            return (f"{guard.kind.value} of {guard.source.name()}: expected {guard.expected_text()}, "
                    f"got {actual} (read at {guard.where})")
        if self.tensor_guard is not None and not self.tensor_guard.check(*self.tensors):
            return str(self.tensor_guard.check_verbose(*self.tensors, tensor_check_names=self.tensor_names))
        return "no difference found"


class CompiledFunction:
    """What `stampout.compile` returns: call it like the original function or module."""

    def __init__(self, fn: Callable, backend: Any = "inductor", max_entries: int = 8,
                 regions: str | None = None) -> None:
        if regions not in (None, "auto"):
            raise StampoutError(message(
                f"regions must be None or 'auto', got {regions!r}", user_location(),
                "pass regions='auto' to mark repeated children of ModuleLists and Sequentials as regions",
            ))
        self.regions = regions
        self.fn = fn
        self.__wrapped__ = fn
        self.backend = resolve(backend)
        self.max_entries = max_entries
        self.stats = CompileStats()
        self.last_capture: Capture | None = None
        self._frame_fn = _frame_function(fn)
        self._entries: list[_Entry] = []
        self._cache = RegionCache()
        self._watch = WriteWatch()
        weakref.finalize(self, self._watch.release)
        install_registration_hooks()
        _LIVE.add(self)

    def reset(self) -> None:
        """Drop every compiled entry and the region cache; unwatch the model."""
        self._watch.release()
        self._entries.clear()
        self._cache = RegionCache()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec, labels = flatten_inputs(args, kwargs)
        with torch._C.DisableTorchFunction():
            key = (fingerprint(spec, leaves), requires_grad_pattern(leaves))
        ctx = CallContext([self.fn, *leaves], self._frame_fn)
        for entry in self._entries:
            if entry.key == key and entry.admits(ctx):
                return self._run(entry, leaves)
        if self._entries and log.isEnabledFor(logging.INFO):
            log.info("guard failed for %s: %s; capturing again", _name(self.fn),
                     self._entries[-1].why_not(ctx, key, labels))
        entry = self._recapture(args, kwargs, key, ctx)
        return self._run(entry, leaves)

    def _run(self, entry: _Entry, leaves: list[Any]) -> Any:
        self.last_capture = entry.capture
        inputs = [leaves[i] for i in entry.capture.input_tensor_leaves]
        inputs += entry.lifted
        return build(entry.capture.output_template, list(entry.compiled(*inputs)))

    def _recapture(self, args: tuple, kwargs: dict, key: tuple, ctx: CallContext) -> _Entry:
        self._watch.release()  # capture watches reads with its own shims
        try:
            marking = (auto_regions(self.fn) if self.regions == "auto" and isinstance(self.fn, torch.nn.Module)
                       else contextlib.nullcontext())
            with marking:
                cap = capture_program(self.fn, args, kwargs, cache=self._cache, guard_program=True)
        finally:
            self._rewatch()
        self.stats.captures += 1
        self.stats.traces += cap.stats.traces
        program = cap.program
        if program.writes:
            raise GuardError(message(
                f"{_name(self.fn)} writes {program.writes[0]}: a compiled call would not repeat that "
                "Python side effect",
                program.writes[0].rsplit(" at ", 1)[-1],
                "keep Python state updates out of the compiled function (or use stampout.capture, which runs "
                "the Python once), or make the state a tensor buffer updated in place",
            ))
        if program.ineligible:
            raise GuardError(message(
                f"cannot guard {_name(self.fn)}: it {program.ineligible[0]}",
                user_location(),
                "pass such values as arguments or keep them as attributes of the module",
            ))
        example = cap.placeholders_for(args, kwargs)
        try:
            compiled = self.backend(cap.gm, example)
        except StampoutError:
            raise
        except Exception as error:
            raise BackendError(message(
                f"backend {getattr(self.backend, '__module__', self.backend)} failed on {_name(self.fn)}: "
                f"{type(error).__name__}: {error}",
                user_location(),
                "try backend='eager' (or 'aot_eager') to see whether the graph or the backend is at fault, "
                "and report it with STAMPOUT_LOGS=+regions output",
            )) from error
        entry = _Entry(cap, compiled, key, ctx, self._watch)
        entry.refresh(ctx)
        if len(self._entries) >= self.max_entries:
            dropped = self._entries.pop(0)
            log.info("%s: more than %d compiled entries; dropping the oldest (%s)", _name(self.fn),
                     self.max_entries, dropped.capture.stats)
        self._entries.append(entry)
        return entry

    def _rewatch(self) -> None:
        memo: dict[Source, Any] = {}
        for entry in self._entries:
            ctx = CallContext([self.fn], self._frame_fn)
            with torch._C.DisableTorchFunction():
                for guard in entry.capture.program.guards:
                    protected(guard, ctx, memo, self._watch)
        EPOCH.bump()


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


def compile(fn: Callable, backend: Any = "inductor", max_entries: int = 8,  # noqa: A001
            regions: str | None = None) -> CompiledFunction:
    """Compile `fn` (a function or `nn.Module`) with stampout's capture and a torch.compile-style backend.

    Example::

        fast = stampout.compile(model, backend="inductor")
        y = fast(x)              # first call: capture, compile; later calls: guards, then the compiled code
        print(fast.stats)        # CompileStats(captures=1, traces=1)

    Args:
        fn: the function or module.
        backend: "eager", "aot_eager", "inductor", or any `callable(gm, example_inputs)`.
        max_entries: compiled variants kept (oldest dropped beyond this).
        regions: "auto" marks repeated children of ModuleLists and Sequentials as regions while capturing.

    Returns:
        A `CompiledFunction` with `.stats` and `.last_capture`.

    Raises:
        GuardError: the program has Python side effects a compiled call could not repeat.
    """
    return CompiledFunction(fn, backend, max_entries, regions)


def reset_all() -> None:
    for fn in list(_LIVE):
        fn.reset()

