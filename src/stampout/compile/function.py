"""stampout.compile: capture and compile on the first call; later calls check guards, then run.

Per call: the input fingerprint and global state; guards that nothing can invalidate behind our back
(globals, closures, objects we cannot watch) as one generated function; the metadata of every buffer and
other tensor the program read in one C++ check (a parameter's metadata changes bump the epoch instead).
Everything else the capture read (module attributes, `training` flags, which parameter objects are where,
hooks) is re-checked only after a write to a watched object bumped the epoch (see tracking.WriteWatch).
A failed guard recaptures, reusing the region cache.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .. import report
from ..backends import background, progress, resolve, timing
from ..capture.arguments import check_arguments, describe, eager_because_lazy, shorten
from ..capture.leftovers import uninitialized_module
from ..capture.lost_gradients import autograd_refusal, updated_with_history
from ..capture.program import capture_program, frame_function
from ..capture.result import Capture
from ..capture.sharded import call_with_hooks, forward_of, is_sharded, region_forward
from ..context import current
from ..errors import BackendError, CaptureError, StampoutError, message
from ..guards.guard import Guard
from ..regions.auto import auto_regions
from ..regions.cache import RegionCache
from ..regions.fingerprint import fingerprint, requires_grad_pattern, without_sizes
from ..regions.frame import ProgramIneligible
from ..sources import Arg, CallContext
from ..torch_internals import DisableTorchFunction, caller_modes, dispatch_modes, function_modes, patch_parameter_writes
from ..trace.frames import failed_at, raised_by_user, symbolic_fault, user_location
from ..trace.names import root_module
from ..trace.structure import argument_names, flatten_inputs
from ..watch.tracking import EPOCH, WriteWatch, install_registration_hooks
from .automatic_dynamic import AutomaticDynamic
from .entries import CallKey, EagerEntry, Entry, new_key
from .piecewise import GraphBreak, collection_paused, first_line, split
from .protection import Protection
from .sharded_twins import twin_entry
from .stats import CompileStats, describe_pieces, family_entries, total_stats

log = logging.getLogger("stampout.guards")
_LIVE: weakref.WeakSet = weakref.WeakSet()


class CompiledFunction:
    """What `stampout.compile` returns: call it like the original function or module."""

    def __init__(self, fn: Callable, backend: Any = "inductor", max_entries: int = 8,
                 regions: str | None = None, dynamic: bool | None = None, fullgraph: bool = False,
                 disable: bool = False) -> None:
        check_arguments(fn, max_entries, fullgraph, disable)
        if regions not in (None, "auto"):
            raise StampoutError(message(
                f"regions must be None or 'auto', got {regions!r}", user_location(),
                "pass regions='auto' to mark repeated children of ModuleLists and Sequentials as regions",
            ))
        if dynamic not in (None, True, False):
            raise StampoutError(message(
                f"dynamic must be None, True or False, got {dynamic!r}", user_location(),
                "None: static first, symbolic sizes for dims seen to change; True: symbolic from the start; "
                "False: a capture per shape",
            ))
        self.regions = regions
        self.dynamic = dynamic
        self.fullgraph = fullgraph  # refuse (raise) where a part of the program would run eagerly
        self.disable = disable  # every call runs `fn` itself, as torch.compile(disable=True)
        self._lazy = eager_because_lazy(fn, fullgraph)  # a generator or async function: every call runs eagerly
        self._seen = AutomaticDynamic(_name(fn), dynamic is not False)  # what the last capture per structure saw
        self._static_only: set[tuple] = set()  # input structures whose symbolic capture failed: static sizes
        self.path = ""  # a piece of a piecewise-compiled module: its path from the root
        self.breaks: list[GraphBreak] = []  # where code runs eagerly and why (shared with its pieces)
        self.pieces: dict[str, CompiledFunction] = {}  # by path: the children compiled on their own
        self.fn = self.__wrapped__ = fn
        self.backend = resolve(backend)
        self.max_entries = max_entries
        self._counts = CompileStats()  # its own; `stats` adds its pieces'
        self.last_capture: Capture | None = None
        self._lineage: tuple[CompiledFunction, ...] = (self,)  # it, and a piece's parents: their last_capture too
        self._frame_fn = frame_function(fn)
        self._sharded = is_sharded(fn)  # fully_shard'ed: its hooks run eagerly, its forward is a region
        self._arg_names = argument_names(fn)  # labels in messages: `input_ids`, not `args[0]`
        self._entries: tuple[Entry | EagerEntry, ...] = ()  # replaced whole (threads read it unlocked)
        self._lock = threading.Lock()  # one recapture at a time; calls that only check guards never take it
        self._cache = RegionCache()
        self._watch = WriteWatch()
        weakref.finalize(self, self._watch.release)
        install_registration_hooks()
        patch_parameter_writes(EPOCH.bump)
        _LIVE.add(self)

    stats = property(total_stats, doc="Captures, region traces and reuses so far, over this function and its pieces.")

    def reset(self) -> None:
        """Drop every compiled entry and the region cache; unwatch the model."""
        with self._lock:
            self._watch.release()
            self._entries = ()
            self._cache = RegionCache()
            self.pieces = {}

    def __repr__(self) -> str:
        return describe(self)

    def __deepcopy__(self, memo: dict) -> CompiledFunction:
        """A copy of the function, compiled afresh with the same settings (compiled code is not copied). A bound
        method's object is copied through `memo`: `copy.deepcopy(model)` after `model.forward = compile(model.forward)`
        gives a copy whose compiled forward runs the copy."""
        copied = CompiledFunction(copy.deepcopy(self.fn, memo), self.backend, self.max_entries, self.regions,
                                  self.dynamic, fullgraph=self.fullgraph, disable=self.disable)
        copied.mode, copied.options = getattr(self, "mode", None), getattr(self, "options", None)
        return copied

    def guard_code(self) -> str:
        """The source of the generated guard predicates of the entry that ran last (thunder's
        `last_prologue_traces`); see `Entry.guard_code`."""
        return report.entry_guard_code(self.last_capture, family_entries(self))

    def explain(self) -> str:
        """Its entries (which run eagerly, and why), the last capture's report and the guard code that admits calls."""
        return report.explain_compiled(self, self._entries, describe_pieces(self))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (self.disable or self._lazy
                or (function_modes() or dispatch_modes()) and caller_modes() and current() is None):
            return self.fn(*args, **kwargs)
        if self._sharded:  # FSDP's hooks run eagerly around the compiled forward (sharded.py)
            forward = forward_of(self.fn)
            return call_with_hooks(self.fn, lambda *a, **k: self._run(forward, a, k), args, kwargs)
        return self._run(self.fn, args, kwargs)

    def _run(self, program: Callable, args: tuple, kwargs: dict) -> Any:
        """A call: `program` (the function, or a sharded module's forward) runs as compiled, or eagerly."""
        leaves, spec, labels = flatten_inputs(args, kwargs, self._arg_names)
        with DisableTorchFunction():
            key = new_key(CallKey, (fingerprint(spec, leaves), requires_grad_pattern(leaves)))
        ctx = CallContext([self.fn, *leaves], self._frame_fn, (args, kwargs))
        hit = self._lookup(key, ctx, leaves)
        if hit is None:
            with self._lock:
                hit = self._lookup(key, ctx, leaves)  # another thread may have captured it meanwhile
                if hit is None:
                    entries = self._entries
                    if entries and log.isEnabledFor(logging.INFO):
                        last = entries[-1]
                        reason = (last.why_not(ctx, key, labels) if isinstance(last, Entry)
                                  else "the last capture could not be guarded")
                        log.info("guard failed for %s: %s; capturing again", _name(self.fn), shorten(reason))
                    with collection_paused():
                        hit = self._recapture(args, kwargs, key, ctx)
        entry, lifted = hit
        if isinstance(entry, (EagerEntry, _EagerOnce)):
            return entry.run(program, args, kwargs)
        cap = entry.capture
        for fn in self._lineage:
            fn.last_capture = cap
        head = tuple([leaves[i] for i in cap.input_tensor_leaves])  # (a tuple of the lifted ones: one copy, not two)
        outputs = list(entry.compiled(*(head + lifted if type(lifted) is tuple else (*head, *lifted))))
        effects = cap.effects
        if effects.effects:
            n = len(outputs) - len(effects.extra)
            entry.replay(ctx, outputs[n:])
            outputs = outputs[:n]
        return entry.outputs(outputs, leaves)

    def _lookup(self, key: CallKey, ctx: CallContext, leaves: list[Any]) -> tuple[Any, tuple] | None:
        masked_keys: dict[frozenset[int], CallKey] = {}
        for entry in self._entries:
            masked = entry.masked
            if masked is None:
                entry_key = key
            else:  # a symbolic capture: the sizes of its dynamic inputs are for its shape guards
                entry_key = masked_keys.get(masked)
                if entry_key is None:
                    entry_key = masked_keys[masked] = entry.key_for(key, leaves)
            if entry.key == entry_key:
                if isinstance(entry, EagerEntry):
                    if entry.admits(ctx):
                        return entry, ()
                    continue
                lifted = entry.admits(ctx)
                if lifted is not None:
                    return entry, lifted
        return None

    def _recapture(self, args: tuple, kwargs: dict, key: CallKey, ctx: CallContext) -> tuple[Any, tuple]:
        refusal = autograd_refusal(self.fn, own_hooks_outside=self._sharded)
        if refusal is not None:  # (only sharded modules below it: FSDP2's designed split, sharded.py; not a warning)
            planned = autograd_refusal(self.fn, own_hooks_outside=self._sharded, sharded_boundaries=True) is None
            return self._run_eagerly(key, f"stampout cannot keep its gradients: {refusal}", None, planned), ()
        if uninitialized_module(self.fn) is not None:  # (a lazy module: this call initializes it, eagerly; the
            return _EagerOnce(), ()  # next captures the initialized model)
        if (twin := twin_entry(self, args, kwargs, key, ctx)) is not None:  # (a sharded block like a sibling)
            return twin
        self._watch.release()  # capture watches reads with its own shims
        try:
            root = root_module(self.fn)  # the module itself, or the one whose bound method was compiled
            marking = (auto_regions(root) if self.regions == "auto" and root is not None
                       else contextlib.nullcontext())
            structure = CallKey(without_sizes(key.fingerprint, ctx.leaves[1:]), key.requires_grad)
            changed = self._seen.dims(structure, ctx)
            automatic = {s.index - 1: dims for s, dims in changed.items() if isinstance(s, Arg)}
            held = {s: dims for s, dims in changed.items() if not isinstance(s, Arg)}
            ints = self._seen.ints(structure, ctx)
            with marking, timing.record(f"capture: {_name(self.fn)}"), timing.phase("capture"):
                try:
                    cap = self._capture(args, kwargs, structure, automatic, held, ints)
                except ProgramIneligible as why:  # (the capture stopped there: nothing was drawn or consumed)
                    self._counts.captures += 1
                    return self._run_eagerly(key, f"stampout cannot guard it: it {why.reason}", why,
                                             only_while=why.only_while), ()
                except Exception as error:  # a CaptureError, or torch's own on the fakes
                    if raised_by_user(error):  # the program's own error: this call runs eagerly, once (eager's
                        if current() is not None:  # error, and the side effects eager makes before it; the
                            raise  # capture undid its own). The next call captures again.
                        return _EagerOnce(), ()
                    pieces = None if current() is not None else split(self, self._piece, first_line(error), error)
                    if pieces is None:  # fullgraph=True, or called inside a capture
                        raise
                    return self._add(EagerEntry(key, first_line(error), pieces)), ()
            self._remember(structure, args, kwargs, cap)
        finally:
            self._rewatch()
        self._counts.captures += 1
        self._counts.traces += cap.stats.traces
        self._counts.reuses += cap.stats.reuses
        program = cap.program
        if program.ineligible:
            only_while = program.ineligible[0].only_while if len(program.ineligible) == 1 else None
            return self._run_eagerly(key, f"stampout cannot guard it: it {program.ineligible[0]}", None,
                                     only_while=only_while), ()
        real = cap.placeholders_for(args, kwargs)
        labels = flatten_inputs(args, kwargs, self._arg_names)[2]
        names = [*(labels[i] for i in cap.input_tensor_leaves), *(source.name() for _, source in cap.lifted)]
        updated = updated_with_history(cap.gm, real, names)
        if updated is not None:
            return self._run_eagerly(key, f"stampout cannot keep its gradients: it updates {updated} in place, a "
                                     "tensor with autograd history of its own (detach what it accumulates)", None), ()
        # A symbolic capture is compiled for every size: the backend gets its fake inputs, whose sizes are
        # symbols of the capture's ShapeEnv (as Dynamo hands backends fakes of its ShapeEnv).
        example = cap.fake_inputs() if cap.shapes is not None else real
        # A recapture (the function already holds a compiled program): Inductor may finish its compile in the
        # background (backends/background.py: a new size's symbolic graph, or a static one's C++ build).
        recompile = any(isinstance(e, Entry) for e in self._entries)
        try:
            with progress.compiling(_name(self.fn)), background.recompiling(recompile):
                compiled = self.backend(cap.gm, example)
        except StampoutError:
            raise
        except Exception as error:
            if cap.shapes is not None:  # torch's tracer cannot take what the symbolic capture hands it
                log.warning("%s: the backend failed on the symbolic capture (%s: %s); capturing with static sizes",
                            _name(self.fn), type(error).__name__, first_line(error))
                self._static_only.add(structure)
                return self._recapture(args, kwargs, key, ctx)
            if not self.fullgraph and getattr(self.backend, "__module__", "").startswith(progress.__package__ + "."):
                return self._run_eagerly(key, f"backend {self.backend.__module__} failed on its graph: "  # (eager
                                         f"{type(error).__name__}: {first_line(error)}", None), ()  # is right)
            raise BackendError(message(
                f"backend {getattr(self.backend, '__module__', self.backend)} failed on {_name(self.fn)}: "
                f"{type(error).__name__}: {error}",
                user_location(),
                "try backend='eager' (or 'aot_eager') to see whether the graph or the backend is at fault, "
                "and report it with STAMPOUT_LOGS=+regions output",
            )) from error
        if cap.shapes is not None:
            if isinstance(compiled, background.Lowering):  # (lowered later: what it assumes beyond the capture
                compiled.assumed_more = cap.shapes.freeze  # becomes the entry's guards then)
            try:
                cap.shapes.freeze()  # after the backend: it may have assumed more about the sizes
                lifted_now = cap.placeholders_for(args, kwargs)[len(cap.input_tensor_leaves):]
                cap.shapes.check(cap.shapes.values(ctx.leaves[1:], lifted_now))  # the guards must run
            except Exception as error:  # torch cannot state the capture's guards: capture with static sizes
                log.warning("%s: the sizes a symbolic capture assumes cannot be guarded (%s: %s); capturing with "
                            "static sizes", _name(self.fn), type(error).__name__, first_line(error))
                self._static_only.add(structure)
                return self._recapture(args, kwargs, key, ctx)
            log.info("%s: captured with symbolic sizes; it assumes %s", _name(self.fn), cap.shapes.summary())
            log.debug("%s: all the symbolic capture assumes: %s", _name(self.fn), cap.shapes.describe())
        # The capture and the compile leave many objects in the collector's young generations: a collection of
        # them now, not in a later call (a 50 ms pause in one decode step of a generate, seven generates later).
        gc.collect(1)
        entry = Entry(cap, compiled, key, ctx, self._watch)
        entry.refresh(ctx)
        # Its full check, now: a later capture (or any watched write) moves EPOCH, and the entry's next call would
        # generate it (in a generate: the first prefill and decode step after the compile, ~40 ms each).
        entry.full_check()
        self._add(entry)
        lifted = entry.admits(ctx)
        if lifted is None:  # the capture itself changed what it read (a side effect the guards see)
            lifted = tuple(cap.placeholders_for(args, kwargs)[len(cap.input_tensor_leaves):])
        return entry, lifted

    def _run_eagerly(self, key: CallKey, why: str, stopped: BaseException | None, planned: bool = False,
                     only_while: Guard | None = None) -> EagerEntry:
        """The entry for inputs whose program stampout cannot guard or keep the gradients of (`why`): it runs eagerly,
        at module granularity where the capture `stopped` inside a child (`planned`: by design); fullgraph refuses.
        `only_while`: `why` holds only while that guard passes (a read tensor is the input); a call where it fails
        captures again."""
        if self.fullgraph:
            raise CaptureError(message(
                f"{_name(self.fn)} cannot be compiled whole (fullgraph=True): {why}", user_location(),
                "remove what the message names from the compiled code, or pass fullgraph=False to run such calls "
                "eagerly",
            ))
        (log.info if planned else log.warning)("%s runs eagerly for these inputs: %s", _name(self.fn), why)
        return self._add(EagerEntry(key, why, split(self, self._piece, why, stopped), only_while))

    def _piece(self, module: torch.nn.Module, path: str) -> CompiledFunction:
        """The compiled function of a child this function's eager code calls (one per child)."""
        piece = self.pieces.get(path)
        if piece is None or piece.fn is not module:  # (a layer swapped in at that path is a module of its own)
            piece = CompiledFunction(module, self.backend, self.max_entries, self.regions, self.dynamic)
            piece._cache, piece.path, piece.breaks = self._cache, path, self.breaks
            piece._lineage = (piece, *self._lineage)
            self.pieces[path] = piece
        return piece

    def _capture(self, args: tuple, kwargs: dict, structure: tuple, automatic: dict, held: dict,
                 ints: set) -> Capture:
        """Capture with the sizes that changed symbolic; where that fails other than by the program's own error
        (an op that cannot take symbolic sizes: `nn.LSTM`'s numel()), capture this input structure with static
        sizes from now on. What fails with static sizes too is the caller's to split (piecewise)."""
        static = structure in self._static_only
        symbolic = not static and (self.dynamic is True or bool(automatic or held or ints))
        try:
            return capture_program(self.fn, args, kwargs, cache=self._cache, guard_program=True,
                                   dynamic=False if static else self.dynamic, automatic={} if static else automatic,
                                   dynamic_sources={} if static else held, dynamic_ints=set() if static else ints,
                                   body=region_forward(self.fn) if self._sharded else None)
        except Exception as error:  # (torch's errors on fakes arrive as CaptureErrors: see op_errors.py)
            if not symbolic or (raised_by_user(error) and not symbolic_fault(error)):
                raise
            log.warning("%s: capturing with symbolic sizes failed (%s: %s at %s); capturing with static sizes "
                        "for these inputs (one capture per size)", _name(self.fn), type(error).__name__,
                        first_line(error), failed_at(error))
            self._static_only.add(structure)
            return self._capture(args, kwargs, structure, automatic, held, ints)

    def _remember(self, structure: tuple, args: tuple, kwargs: dict, cap: Capture) -> None:
        leaves, _, labels = flatten_inputs(args, kwargs, self._arg_names)
        self._seen.remember(structure, leaves, labels, cap)

    def _add(self, entry: Any) -> Any:
        entries = list(self._entries)
        if len(entries) >= self.max_entries:
            dropped = entries.pop(0)
            log.info("%s: more than %d compiled entries; dropping the oldest (%s)", _name(self.fn),
                     self.max_entries, getattr(dropped.capture, "stats", "eager"))
        entries.append(entry)
        self._entries = tuple(entries)
        return entry

    def _rewatch(self) -> None:
        protection = Protection(CallContext([self.fn], self._frame_fn), {}, self._watch)
        with DisableTorchFunction():
            for entry in (e for e in self._entries if not isinstance(e, EagerEntry)):
                for guard in entry.guards:
                    protection.guard(guard)
                for source in entry.fixed_sources:
                    if source is not None:
                        protection.path(source)
        EPOCH.bump()


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


class _EagerOnce:  # a call whose capture raised the program's own error runs eagerly; nothing is kept
    run = staticmethod(lambda program, args, kwargs: program(*args, **kwargs))  # (eager's effects, eager's error)


def reset_all() -> None:
    for fn in list(_LIVE):
        fn.reset()

