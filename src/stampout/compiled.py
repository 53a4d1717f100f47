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
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .backends import resolve
from .capture import Capture
from .capturing import capture_program, frame_function
from .effects import replay
from .errors import BackendError, GuardError, StampoutError, message
from .frames import user_location
from .guards import Guard, Kind, compile_guards, first_failure, tensor_kind
from .names import root_module
from .regions.auto import auto_regions
from .regions.cache import RegionCache
from .regions.fingerprint import (
    describe_difference,
    fingerprint,
    requires_grad_pattern,
    without_sizes,
)
from .regions.frame import ProgramIneligible
from .sources import MISSING, Absolute, Arg, Attr, CallContext, Item, Source, TypeOf
from .structure import build, flatten_inputs
from .torch_internals import dict_sentinel, tensor_guards
from .tracking import EPOCH, WriteWatch, install_registration_hooks
from .world import autograd_refusal

log = logging.getLogger("stampout.guards")
_LIVE: weakref.WeakSet = weakref.WeakSet()


@dataclass
class CompileStats:
    """Whole-program captures so far, and region traces over all of them."""

    captures: int = 0
    traces: int = 0


def _instance_dict_item(source: Source) -> bool:
    """`obj.__dict__[name]`: written through `obj`'s own `__setattr__`, like an attribute."""
    parent = source.base()
    return isinstance(source, Item) and isinstance(parent, Attr) and parent.attr == "__dict__"


def _values_in_dict(guard: Guard) -> bool:
    """A protected guard on a value a module holds in its `__dict__` (a constant, a config object; not a
    parameter, a submodule, `training` or the absence of a per-instance `forward`): its module's dict is
    version-checked on every call, so writes that bypass `__setattr__` are seen."""
    source = guard.source
    if guard.kind in (Kind.TENSOR, Kind.HOOKS, Kind.TYPE, Kind.NO_OVERRIDE):
        return False
    return not (isinstance(source, Attr) and source.attr == "training")


def by_class(guards: list[Guard], ctx: CallContext) -> list[Guard]:
    """Guards on class attributes read through instances, as guards on the classes themselves (each
    instance's class is guarded separately): one check per class instead of one per instance."""
    out: list[Guard] = []
    seen: set[tuple] = set()
    memo: dict[Source, Any] = {}

    def on_class(source: Source) -> Source:
        if isinstance(source, TypeOf):
            cls = source.resolve(ctx, memo)
            return Absolute(cls, cls.__qualname__)
        parent = source.base()
        if parent is None:
            return source
        new = on_class(parent)
        return source if new is parent else source.with_parent(new)

    for guard in guards:
        source = on_class(guard.source)
        if source is not guard.source:
            if (source, guard.kind) in seen:
                continue
            seen.add((source, guard.kind))
            guard = Guard(source, guard.kind, guard.expected, guard.where)
        out.append(guard)
    return out


def _relax_symbolic(guards: list[Guard], cap: Capture, ctx: CallContext) -> list[Guard]:
    """A tensor the capture held with symbolic sizes is guarded on its kind only; its shape guards check the
    sizes (the exact-metadata guard its reads left would defeat the symbolic capture)."""
    if cap.shapes is None:
        return guards
    dynamic = {id(cap.lifted[i][0]) for i in cap.shapes.lifted}
    memo: dict[Source, Any] = {}
    out = []
    for guard in guards:
        if guard.kind is Kind.SIZE:
            continue  # an int captured as a symbol: it is an input of the graph, checked by the shape guards
        if guard.kind is Kind.TENSOR:
            value = guard.source.resolve(ctx, memo)
            if id(value) in dynamic:
                guard = Guard(guard.source, Kind.TENSOR_KIND, tensor_kind(value), guard.where)
        out.append(guard)
    return out


def _path(source: Source) -> list[Source]:
    out = [source]
    while (parent := out[-1].base()) is not None:
        out.append(parent)
    return out[::-1]


def protected(guard: Guard, ctx: CallContext, memo: dict, watch: WriteWatch) -> bool:
    """Whether a write to a watched object is the only way this guard's value can change (watching the
    objects on its path as a side effect)."""
    if guard.kind is Kind.HOOKS and guard.expected != ((), (), (), ()):
        return False  # hooks registered before compile may be removed through old handles
    if guard.kind is Kind.SAME:
        return False
    if guard.kind is Kind.CONST and guard.expected[0] in (list, dict, set):
        return False  # a mutable container: changed in place without any write to its holder
    return protected_path(guard.source, ctx, memo, watch)


def protected_path(source: Source, ctx: CallContext, memo: dict, watch: WriteWatch) -> bool:
    """Whether every step to `source` is an attribute of a watched object reached from the module itself."""
    path = _path(source)
    if not (isinstance(path[0], Arg) and path[0].index == 0):
        return False  # globals, closures, per-call input objects: checked on every call
    for source in path[:-1]:
        if isinstance(source, Attr) and source.attr == "__dict__":
            continue  # the owner is watched: its __setattr__ writes this dict
        if source.base() is not None and not isinstance(source, Attr) and not _instance_dict_item(source):
            return False  # an item of a container: containers are not watched
        obj = source.resolve(ctx, memo)
        # Only modules: their state changes through __setattr__ and registries that bump the epoch. Other
        # objects (configs, dicts, lists, namespaces) are written in too many ways; their guards run per call.
        if obj is MISSING or not isinstance(obj, torch.nn.Module) or not watch.watch(obj):
            return False
    return True


class _State:
    """What a full guard check established, valid while EPOCH stays at `epoch`: the protected tensors (their
    metadata checked in one C++ call) and the lifted inputs that only a watched write could move."""

    __slots__ = ("epoch", "tensors", "names", "fixed", "tensor_guard", "unwritten")

    def __init__(self, epoch: int, tensors: list, names: list, fixed: list, tensor_guard: Any,
                 unwritten: Callable[[], bool]) -> None:
        self.epoch = epoch
        self.unwritten = unwritten  # the watched modules' __dict__s are as they were (no bypassing write)
        self.tensors = tensors
        self.names = names
        self.fixed = fixed
        self.tensor_guard = tensor_guard


class _Entry:
    """One capture and its compiled callable, with the guards that say when it may run.

    Guards whose value only a write to a watched object can change are checked after such a write (EPOCH
    moved); all others run on every call in one generated function, which also returns the lifted tensors
    that cannot be proven unchanged (globals, closures, tensors held by input objects or in containers):
    those are read from their sources on every call, never reused from an earlier one."""

    def __init__(self, cap: Capture, compiled: Callable, key: tuple, ctx: CallContext, watch: WriteWatch):
        self.capture = cap
        self.compiled = compiled
        self.shapes = cap.shapes  # a symbolic capture: its inputs' sizes are checked by its shape guards
        self.masked = frozenset(cap.shapes.leaves) if cap.shapes is not None else None
        self.key = self.key_for(key, ctx.leaves[1:])
        with torch._C.DisableTorchFunction():
            guards = self.guards = _relax_symbolic(by_class(cap.program.guards, ctx), cap, ctx)
        self._full: Callable | None = None  # generated on first need: thousands of guards for a deep model
        always: list[Guard] = []
        tensors: list[Guard] = []
        self.protected_sources: list[tuple[Source, bool]] = []  # (source, guarded absent?)
        memo: dict[Source, Any] = {}
        with torch._C.DisableTorchFunction():
            for guard in guards:
                if not protected(guard, ctx, memo, watch):
                    always.append(guard)
                elif guard.kind is Kind.TENSOR:
                    tensors.append(guard)
                elif _values_in_dict(guard):
                    self.protected_sources.append((guard.source, guard.kind is Kind.ABSENT))
            self.fixed_sources: list[Source | None] = []  # per lifted input; None: read per call
            per_call: list[Source] = []
            self.per_call_positions: list[int] = []
            for position, (_, source) in enumerate(cap.lifted):
                if protected_path(source, ctx, memo, watch):
                    self.fixed_sources.append(source)
                else:
                    self.fixed_sources.append(None)
                    self.per_call_positions.append(position)
                    per_call.append(source)
        self.always = compile_guards(always, per_call)
        self.tensor_sources = [g.source for g in tensors]
        self.state: _State | None = None

    def refresh(self, ctx: CallContext) -> _State:
        """After a full check passed: the current protected tensors, and a C++ check of their metadata."""
        memo: dict[Source, Any] = {}
        with torch._C.DisableTorchFunction():
            tensors = [s.resolve(ctx, memo) for s in self.tensor_sources]
            fixed = [None if s is None else s.resolve(ctx, memo) for s in self.fixed_sources]
        # One entry per tensor object: tied weights (lm_head.weight is wte.weight) reach it by two paths,
        # and TensorGuards rejects a tensor listed twice. Which paths lead to which object is guarded by
        # the full check, after any write that could change it.
        names = {id(t): s.name() for s, t in zip(reversed(self.tensor_sources), reversed(tensors))}
        unique = list({id(t): t for t in [*tensors, *fixed] if isinstance(t, torch.Tensor)}.values())
        modules: dict[int, torch.nn.Module] = {}
        with torch._C.DisableTorchFunction():
            for source, absent in self.protected_sources:
                parent = source.base()
                if isinstance(parent, Attr) and parent.attr == "__dict__":
                    parent = parent.base()
                obj = parent.resolve(ctx, memo) if parent is not None else MISSING
                name = getattr(source, "attr", getattr(source, "item", None))
                if isinstance(obj, torch.nn.Module) and (absent or name in obj.__dict__):
                    modules[id(obj)] = obj
        state = _State(EPOCH.value, unique, [names.get(id(t), "a lifted tensor") for t in unique], tuple(fixed),
                       tensor_guards(unique), dict_sentinel([m.__dict__ for m in modules.values()]))
        self.state = state
        return state

    def admits(self, ctx: CallContext) -> tuple | None:
        """None when a guard fails; else the lifted inputs for this call, in placeholder order."""
        per_call = self.always(ctx.leaves, ctx.fn)
        if per_call is False:
            return None
        state = self.state
        if state is None or state.epoch != EPOCH.value or not state.unwritten():
            if self._full is None:
                self._full = compile_guards(self.guards)
            with torch._C.DisableTorchFunction():
                if not self._full(ctx.leaves, ctx.fn):
                    return None
            state = self.refresh(ctx)
        if not state.tensor_guard.check(*state.tensors):
            return None
        if per_call:
            lifted = list(state.fixed)
            for position, value in zip(self.per_call_positions, per_call):
                lifted[position] = value
        else:
            lifted = state.fixed
        shapes = self.shapes
        if shapes is not None and not shapes.check(shapes.values(ctx.leaves[1:], lifted)):
            return None
        return lifted

    def key_for(self, key: tuple, leaves: list[Any]) -> tuple:
        """A call's key as this entry compares it: without the sizes its shape guards check."""
        return key if self.masked is None else (without_sizes(key[0], leaves, self.masked), key[1])

    def why_not(self, ctx: CallContext, key: tuple, labels: list[str]) -> str:
        shapes = self.shapes
        if shapes is not None:
            key = self.key_for(key, ctx.leaves[1:])
            if key == self.key:
                lifted = self.capture.placeholders_for_lifted(ctx)
                values = shapes.values(ctx.leaves[1:], lifted)
                if not shapes.check(values):
                    return f"the symbolic capture assumed {shapes.why_not(values)}"
        if key != self.key:
            if key[0] != self.key[0]:
                return "inputs: " + describe_difference(self.key[0], key[0], labels)
            return "which inputs require grad differs"
        failure = first_failure(self.guards, ctx)
        if failure is not None:
            _, guard, actual = failure
            return (f"{guard.kind.value} of {guard.source.name()}: expected {guard.expected_text()}, "
                    f"got {actual} (read at {guard.where})")
        state = self.state
        if state is not None and not state.tensor_guard.check(*state.tensors):
            return str(state.tensor_guard.check_verbose(*state.tensors, tensor_check_names=state.names))
        return "no difference found"


class _EagerEntry:
    """Calls with this key run the original function: its capture read something stampout cannot guard."""

    def __init__(self, key: tuple, reason: str) -> None:
        self.key = key
        self.reason = reason
        self.capture = None
        self.masked = None


class CompiledFunction:
    """What `stampout.compile` returns: call it like the original function or module."""

    def __init__(self, fn: Callable, backend: Any = "inductor", max_entries: int = 8,
                 regions: str | None = None, dynamic: bool | None = None) -> None:
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
        # Per input structure (the fingerprint without sizes), what the last capture saw, for automatic dynamic
        # shapes: the sizes of the call's tensors and of those it lifted (a KV cache's layers), by source, and
        # the int attributes it read as constants (a cache layer's position); and what was seen to change.
        self._seen_sizes: dict[tuple, dict[Source, tuple[int, ...]]] = {}
        self._changed_dims: dict[tuple, dict[Source, set[int]]] = {}
        self._seen_ints: dict[tuple, dict[Source, int]] = {}
        self._changed_ints: dict[tuple, set[Source]] = {}
        self.fn = fn
        self.__wrapped__ = fn
        self.backend = resolve(backend)
        self.max_entries = max_entries
        self.stats = CompileStats()
        self.last_capture: Capture | None = None
        self._frame_fn = frame_function(fn)
        self._entries: tuple[_Entry | _EagerEntry, ...] = ()  # replaced whole (threads read it unlocked)
        self._lock = threading.Lock()  # one recapture at a time; calls that only check guards never take it
        self._cache = RegionCache()
        self._watch = WriteWatch()
        weakref.finalize(self, self._watch.release)
        install_registration_hooks()
        _LIVE.add(self)

    def reset(self) -> None:
        """Drop every compiled entry and the region cache; unwatch the model."""
        with self._lock:
            self._watch.release()
            self._entries = ()
            self._cache = RegionCache()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec, labels = flatten_inputs(args, kwargs)
        with torch._C.DisableTorchFunction():
            key = (fingerprint(spec, leaves), requires_grad_pattern(leaves))
        ctx = CallContext([self.fn, *leaves], self._frame_fn)
        hit = self._lookup(key, ctx, leaves)
        if hit is None:
            with self._lock:
                hit = self._lookup(key, ctx, leaves)  # another thread may have captured it meanwhile
                if hit is None:
                    entries = self._entries
                    if entries and log.isEnabledFor(logging.INFO):
                        last = entries[-1]
                        reason = (last.why_not(ctx, key, labels) if isinstance(last, _Entry)
                                  else "the last capture could not be guarded")
                        log.info("guard failed for %s: %s; capturing again", _name(self.fn), reason)
                    hit = self._recapture(args, kwargs, key, ctx)
        entry, lifted = hit
        if isinstance(entry, _EagerEntry):
            return self.fn(*args, **kwargs)
        cap = entry.capture
        self.last_capture = cap
        inputs = [leaves[i] for i in cap.input_tensor_leaves]
        inputs.extend(lifted)
        outputs = list(entry.compiled(*inputs))
        effects = cap.effects
        if effects.effects:
            n = len(outputs) - len(effects.extra)
            replay(effects.effects, ctx, outputs[n:])
            outputs = outputs[:n]
        return build(cap.output_template, outputs, leaves)

    def _lookup(self, key: tuple, ctx: CallContext, leaves: list[Any]) -> tuple[Any, tuple] | None:
        masked_keys: dict[frozenset[int], tuple] = {}
        for entry in self._entries:
            masked = entry.masked
            if masked is None:
                entry_key = key
            else:  # a symbolic capture: the sizes of its dynamic inputs are for its shape guards
                entry_key = masked_keys.get(masked)
                if entry_key is None:
                    entry_key = masked_keys[masked] = entry.key_for(key, leaves)
            if entry.key == entry_key:
                if isinstance(entry, _EagerEntry):
                    return entry, ()
                lifted = entry.admits(ctx)
                if lifted is not None:
                    return entry, lifted
        return None

    def _recapture(self, args: tuple, kwargs: dict, key: tuple, ctx: CallContext) -> tuple[Any, tuple]:
        refusal = autograd_refusal(self.fn)
        if refusal is not None:
            log.warning("%s runs eagerly for these inputs: %s", _name(self.fn), refusal)
            return self._add(_EagerEntry(key, refusal)), ()
        self._watch.release()  # capture watches reads with its own shims
        try:
            root = root_module(self.fn)  # the module itself, or the one whose bound method was compiled
            marking = (auto_regions(root) if self.regions == "auto" and root is not None
                       else contextlib.nullcontext())
            structure = (without_sizes(key[0], ctx.leaves[1:]), key[1])
            changed = self._automatic_dims(structure, ctx)
            automatic = {s.index - 1: dims for s, dims in changed.items() if isinstance(s, Arg)}
            held = {s: dims for s, dims in changed.items() if not isinstance(s, Arg)}
            ints = self._automatic_ints(structure, ctx)
            with marking:
                try:
                    cap = capture_program(self.fn, args, kwargs, cache=self._cache, guard_program=True,
                                          dynamic=self.dynamic, automatic=automatic, dynamic_sources=held,
                                          dynamic_ints=ints)
                except ProgramIneligible as why:  # (the capture stopped there: nothing was drawn or consumed)
                    self.stats.captures += 1
                    log.warning("%s runs eagerly for these inputs: stampout cannot guard it: it %s", _name(self.fn),
                                why.reason)
                    return self._add(_EagerEntry(key, why.reason)), ()
            self._remember(structure, args, kwargs, cap)
        finally:
            self._rewatch()
        self.stats.captures += 1
        self.stats.traces += cap.stats.traces
        program = cap.program
        if cap.effects.refused:
            raise GuardError(message(
                f"{_name(self.fn)} {cap.effects.refused}: a compiled call cannot repeat that Python side effect",
                user_location(),
                "keep such Python state updates out of the compiled function (attribute stores of constants and "
                "tensors, list appends and dict stores are replayed), or use stampout.capture",
            ))
        if program.ineligible:
            log.warning("%s runs eagerly for these inputs: stampout cannot guard it: it %s", _name(self.fn),
                        program.ineligible[0])
            return self._add(_EagerEntry(key, program.ineligible[0])), ()
        # A symbolic capture is compiled for every size: the backend gets its fake inputs, whose sizes are
        # symbols of the capture's ShapeEnv (as Dynamo hands backends fakes of its ShapeEnv).
        example = cap.fake_inputs() if cap.shapes is not None else cap.placeholders_for(args, kwargs)
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
        if cap.shapes is not None:
            cap.shapes.freeze()  # after the backend: it may have assumed more about the sizes
            log.info("%s: captured with symbolic sizes; it assumes %s", _name(self.fn), cap.shapes.describe())
        entry = _Entry(cap, compiled, key, ctx, self._watch)
        entry.refresh(ctx)
        self._add(entry)
        lifted = entry.admits(ctx)
        if lifted is None:  # the capture itself changed what it read (a side effect the guards see)
            lifted = tuple(cap.placeholders_for(args, kwargs)[len(cap.input_tensor_leaves):])
        return entry, lifted

    def _automatic_dims(self, structure: tuple, ctx: CallContext) -> dict[Source, set[int]]:
        """The dims that changed since the last capture with this input structure, of the call's tensors
        (`Arg` sources) and of the tensors it read through the inputs' objects or the module (a KV cache growing
        by a token per call) — torch.compile's automatic dynamic shapes. They stay symbolic in later captures.
        (With dynamic=True held tensors are found by a capture, so they too become symbolic at a first change.)"""
        if self.dynamic is False:
            return {}
        dims = self._changed_dims.setdefault(structure, {})
        memo: dict[Source, Any] = {}
        with torch._C.DisableTorchFunction():
            for source, old in self._seen_sizes.get(structure, {}).items():
                value = source.resolve(ctx, memo)
                if not isinstance(value, torch.Tensor) or value.dim() != len(old):
                    continue
                changed = {d for d, (a, b) in enumerate(zip(old, value.shape)) if a != b} - dims.get(source, set())
                if changed:
                    dims.setdefault(source, set()).update(changed)
                    log.info("%s: %s changed size in dim %s (%s -> %s): capturing it with symbolic sizes",
                             _name(self.fn), source.name(), sorted(changed), list(old), list(value.shape))
        return dims

    def _automatic_ints(self, structure: tuple, ctx: CallContext) -> set[Source]:
        """Int attributes whose value the last capture with this input structure read and that changed since
        (a call counter, a cache layer's position): captured as symbols from now on."""
        if self.dynamic is False:
            return set()
        changed = self._changed_ints.setdefault(structure, set())
        memo: dict[Source, Any] = {}
        with torch._C.DisableTorchFunction():
            for source, old in self._seen_ints.get(structure, {}).items():
                value = source.resolve(ctx, memo)
                if type(value) is int and value != old and source not in changed:
                    changed.add(source)
                    log.info("%s: %s changed (%d -> %d): capturing it as a symbolic int", _name(self.fn),
                             source.name(), old, value)
        return changed

    def _remember(self, structure: tuple, args: tuple, kwargs: dict, cap: Capture) -> None:
        """What this capture saw, for the next capture with the same input structure to compare with."""
        leaves, _, labels = flatten_inputs(args, kwargs)
        sizes: dict[Source, tuple[int, ...]] = {Arg(i + 1, labels[i]): tuple(leaf.shape)
                                                for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
        sizes.update({source: tuple(t.shape) for t, source in cap.lifted
                      if source is not None and isinstance(t, torch.Tensor)})
        self._seen_sizes[structure] = sizes
        self._seen_ints[structure] = {g.source: g.expected[1] for g in cap.program.guards
                                      if g.kind is Kind.CONST and g.expected[0] is int and isinstance(g.source, Attr)}

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
        memo: dict[Source, Any] = {}
        ctx = CallContext([self.fn], self._frame_fn)
        with torch._C.DisableTorchFunction():
            for entry in self._entries:
                if isinstance(entry, _EagerEntry):
                    continue
                for guard in entry.guards:
                    protected(guard, ctx, memo, self._watch)
                for source in entry.fixed_sources:
                    if source is not None:
                        protected_path(source, ctx, memo, self._watch)
        EPOCH.bump()


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


def compile(fn: Callable, backend: Any = "inductor", max_entries: int = 8,  # noqa: A001
            regions: str | None = None, dynamic: bool | None = None) -> CompiledFunction:
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
        dynamic: as torch.compile's. None: static first; a call whose inputs differ only in sizes recaptures
            with the dims that changed symbolic, so later sizes reuse it. True: every input dim symbolic from
            the first call (sizes 0 and 1 stay static). False: a capture per shape. Dims marked with
            `torch._dynamo.mark_dynamic` are symbolic in every mode, `mark_static` ones never.

    Returns:
        A `CompiledFunction` with `.stats` and `.last_capture`.

    Raises:
        GuardError: the program has Python side effects a compiled call could not repeat.
    """
    return CompiledFunction(fn, backend, max_entries, regions, dynamic)


def reset_all() -> None:
    for fn in list(_LIVE):
        fn.reset()

