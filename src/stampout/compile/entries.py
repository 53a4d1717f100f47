"""A compiled function's entries: one capture with its compiled graph, the guards that admit a call to it (the
generated predicate, refreshed when a watched object changes) and why a call was not admitted; and the entry
that runs a program eagerly (with its compiled pieces, where it broke)."""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..capture.effects import Effect, Value, ValueKind
from ..capture.result import Capture
from ..errors import StampoutError
from ..guards.guard import DeferredTensors, Guard, Kind, compile_guards, first_failure, tensor_kind
from ..guards.instance_facts import InstanceFacts
from ..regions.fingerprint import describe_difference, without_sizes
from ..sources import MISSING, Absolute, AnchoredContext, Attr, CallContext, Source, TypeOf
from ..torch_internals import DisableTorchFunction, instance_dicts_sentinel, tensor_guards
from ..trace.memory import memory_span, spans_of
from ..trace.structure import aliases_of
from ..watch.tracking import EPOCH, WriteWatch
from .fsdp_swaps import SwappedParams, swapped
from .outputs import OutputBuilder
from .per_call_aliases import PerCallAliases, overlaps_fixed
from .piecewise import Pieces
from .protection import Anchors, Protection, anchored
from .replay_code import compile_replay

log = logging.getLogger("stampout.guards")


class CallKey(NamedTuple):
    """What a compiled call is looked up by: its inputs' fingerprint and which tensor inputs require grad."""

    fingerprint: tuple
    requires_grad: tuple[bool, ...]


new_key = tuple.__new__  # a CallKey without NamedTuple's keyword __new__ (every call builds one)


def _values_in_dict(guard: Guard) -> bool:
    """A protected guard on a value a module holds in its `__dict__` (a constant, a config object, a tensor kept as
    a plain attribute; not a parameter, a submodule, `training` or the absence of a per-instance `forward`): its
    module's dict is version-checked on every call, so writes that bypass `__setattr__` are seen."""
    source = guard.source
    if guard.kind in (Kind.HOOKS, Kind.TYPE, Kind.NO_OVERRIDE):
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
            cls = source.resolve(ctx, memo)  # (MISSING: read through a place the call itself filled, now empty)
            return Absolute(cls, cls.__qualname__) if isinstance(cls, type) else source
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


def relax_symbolic(guards: list[Guard], cap: Capture, ctx: CallContext) -> list[Guard]:
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


def _anchored_effect(effect: Effect, anchors: Anchors) -> Effect:
    """`effect` with its target and the sources of its values starting from anchors."""
    values = tuple(Value(v.kind, anchors.rewrite(v.value)) if v.kind is ValueKind.SOURCE else v for v in effect.values)
    return dataclasses.replace(effect, target=anchors.rewrite(effect.target), values=values)


def _same_guards(ours: list[Guard], theirs: list[Guard]) -> bool:
    """The same checks: equal sources and kinds, the same expected objects (a sibling's come from one capture)."""
    return len(ours) == len(theirs) and all(a is b or (a.kind is b.kind and a.expected is b.expected
                                                       and a.source == b.source) for a, b in zip(ours, theirs))


def _tensors(leaves: list[Any]) -> list[torch.Tensor]:
    """The call's tensor inputs (after the function, `leaves[0]`)."""
    return [v for v in leaves[1:] if isinstance(v, torch.Tensor)]


class EntryState:
    """What a full guard check established, valid while EPOCH stays at `epoch`: the protected tensors (their
    metadata checked in one C++ call) and the lifted inputs that only a watched write could move."""

    __slots__ = ("epoch", "tensors", "names", "fixed", "known", "bases", "tensor_guard", "unwritten", "anchors")

    def __init__(self, epoch: int, tensors: list, names: list, fixed: tuple, tensor_guard: Any,
                 unwritten: Callable[[], bool], anchors: tuple) -> None:
        self.epoch = epoch
        self.known: tuple = ()  # the fixed lifted inputs alone, in placeholder order (see _merge_order)
        self.bases = spans_of(fixed)  # the memory of the fixed lifted tensors, for overlaps_fixed (per_call_aliases.py)
        self.anchors = anchors  # the objects the per-call check starts from (protection.Anchors)
        self.unwritten = unwritten  # the watched modules' __dict__s are as they were (no bypassing write, none replaced)
        self.tensors = tensors
        self.names = names
        self.fixed = fixed
        self.tensor_guard = tensor_guard


class Entry:
    """One capture and its compiled callable, with the guards that say when it may run.

    Guards whose value only a write to a watched object can change are checked after such a write (EPOCH
    moved); all others run on every call in one generated function, which also returns the lifted tensors
    that cannot be proven unchanged (globals, closures, tensors held by input objects or in containers):
    those are read from their sources on every call, never reused from an earlier one. That function starts
    from anchors (objects reached through watched modules, resolved after each write), not from the root."""

    def __init__(self, cap: Capture, compiled: Callable, key: CallKey, ctx: CallContext, watch: WriteWatch,
                 like: Entry | None = None):
        self.capture = cap
        self.compiled = compiled
        self.outputs = OutputBuilder(cap.output_template)  # (the call's outputs rebuilt: outputs.py)
        self.shapes = cap.shapes  # a symbolic capture: its inputs' sizes are checked by its shape guards
        self.masked = frozenset(cap.shapes.leaves) if cap.shapes is not None else None
        self.key = self.key_for(key, ctx.leaves[1:])
        with DisableTorchFunction():
            guards = self.guards = relax_symbolic(by_class(cap.program.guards, ctx), cap, ctx)
        self._full: Callable | None = None  # the full check (full_check()): thousands of guards for a deep model
        if like is not None and _same_guards(guards, like.guards):  # (`like`: a sibling block's, sharded_twins.py)
            self._full = like._full = like._full or compile_guards(like.guards)  # (a function of its guards)
        always: list[Guard] = []
        tensors: list[Guard] = []
        self.protected_sources: list[tuple[Source, bool]] = []  # (source, guarded absent?)
        memo: dict[Source, Any] = {}
        protection = Protection(ctx, memo, watch)
        protected: list[Source] = []
        with DisableTorchFunction():
            for guard in guards:
                if not protection.guard(guard):
                    always.append(guard)
                    continue
                protected.append(guard.source)
                if guard.kind is Kind.TENSOR:
                    tensors.append(guard)
                if _values_in_dict(guard):
                    self.protected_sources.append((guard.source, guard.kind is Kind.ABSENT))
            self.fixed_sources: list[Source | None] = []  # per lifted input; None: read per call
            per_call: list[Source] = []
            self.per_call_positions: list[int] = []
            for position, (_, source) in enumerate(cap.lifted):
                if protection.path(source):
                    self.fixed_sources.append(source)
                else:
                    self.fixed_sources.append(None)
                    self.per_call_positions.append(position)
                    per_call.append(source)
            self.anchors = Anchors(protection)
            effects = cap.effects.effects if cap.effects is not None else []
            self.effects = [(_anchored_effect(e, self.anchors), e) for e in effects]
            self._replay = compile_replay([anchored for anchored, _ in self.effects])
            always = anchored(always, self.anchors)
            per_call = [self.anchors.rewrite(source) for source in per_call]
        # (FSDP's swapped parameters among what the cached state read: checked per call, see fsdp_swaps.py)
        self.swapped = SwappedParams([*protected, *self.fixed_sources, *(p for g in self.anchors.groups for p in g)])
        self._per_call_guards = (always, per_call)
        if like is not None and _same_guards(always, like._per_call_guards[0]) and per_call == like._per_call_guards[1]:
            self.always, self.deferred_guards = like.always, like.deferred_guards
        else:
            self.deferred_guards = deferred = []
            self.always = compile_guards(always, per_call, deferred)
        self.deferred = DeferredTensors(self.deferred_guards)  # the per-call tensors' metadata: one C++ check
        self.held = InstanceFacts(always, per_call, self.deferred_guards)  # (its memo: instance_facts.py)
        self.per_call_count = len(per_call)
        # Which of the tensor inputs and the tensors read per call (held by input objects: `box.a`, `box.b`) are
        # the same object or overlap, as at capture (the key holds the inputs' own aliasing only): a functionalized
        # graph traced on distinct tensors is wrong on aliased ones. (None: no tensor is read per call.)
        # Which tensor inputs overlap a parameter or buffer the graph reads (`model(model.lin.weight.detach())`), as
        # at capture: checked per call against the fixed lifted tensors' storages (EntryState.bases).
        fixed_at_capture = [None if s is None else cap.lifted[i][0] for i, s in enumerate(self.fixed_sources)]
        self.fixed_overlaps = overlaps_fixed(_tensors(ctx.leaves), fixed_at_capture, spans_of(fixed_at_capture))
        if self.per_call_positions:
            read = [cap.lifted[i][0] for i in self.per_call_positions]
            pinned = self.shapes is None and set(per_call) <= {g.source for g in self.deferred_guards}
            self.aliases: PerCallAliases | None = PerCallAliases(
                aliases_of([v for v in (*ctx.leaves[1:], *read) if isinstance(v, torch.Tensor)]), pinned)
        else:
            self.aliases = None
        self.tensor_sources = [g.source for g in tensors]
        self.state: EntryState | None = None
        self._merge = _merge_order([s is not None for s in self.fixed_sources])

    def refresh(self, ctx: CallContext) -> EntryState | None:
        """After a full check passed: the current protected tensors, a C++ check of their metadata, and the
        anchors; None when the anchors no longer hold (the entry is dropped from lookups)."""
        memo: dict[Source, Any] = {}
        with DisableTorchFunction():
            tensors = [s.resolve(ctx, memo) for s in self.tensor_sources]
            fixed = [None if s is None else s.resolve(ctx, memo) for s in self.fixed_sources]
            anchors = self.anchors.resolve(ctx, memo)
        if anchors is None:
            log.info("a write made objects the per-call check shares differ; this entry is dropped")
            self.key = None  # never matches a call again: a recapture makes an entry for the new world
            self.state = None
            return None
        # One entry per tensor object: tied weights (lm_head.weight is wte.weight) reach it by two paths,
        # and TensorGuards rejects a tensor listed twice. Which paths lead to which object is guarded by
        # the full check, after any write that could change it.
        names = {id(t): s.name() for s, t in zip(reversed(self.tensor_sources), reversed(tensors))}
        unique = list({id(t): t for t in [*tensors, *fixed] if isinstance(t, torch.Tensor)}.values())
        # Parameters change metadata only through writes that bump EPOCH (torch_internals.patch_parameter_writes):
        # the full check covers them. One stays in the per-call check, as the sentinel of the thread's dispatch
        # state (inference mode, autocast, functorch transforms), which the C++ check compares for every tensor.
        parameters = [t for t in unique if isinstance(t, torch.nn.Parameter)]
        unique = [t for t in unique if not isinstance(t, torch.nn.Parameter)] + parameters[:1]
        modules: dict[int, torch.nn.Module] = {}
        with DisableTorchFunction():
            for source, absent in self.protected_sources:
                parent = source.base()
                if isinstance(parent, Attr) and parent.attr == "__dict__":
                    parent = parent.base()
                obj = parent.resolve(ctx, memo) if parent is not None else MISSING
                name = getattr(source, "attr", getattr(source, "item", None))
                if isinstance(obj, torch.nn.Module) and (absent or name in obj.__dict__):
                    modules[id(obj)] = obj
            modules.update((id(m), m) for m in self.anchors.holders(ctx, memo))
            for source in self.fixed_sources:  # (a lifted parameter's module: `m.__dict__["weight"] = t` shadows it)
                holder = source.base().resolve(ctx, memo) if isinstance(source, Attr) else None
                if isinstance(holder, torch.nn.Module) and source.attr not in holder.__dict__ \
                        and not swapped(holder, source.attr):  # (FSDP's: checked by SwappedParams)
                    modules[id(holder)] = holder
            unwritten = self.swapped.and_held(instance_dicts_sentinel(list(modules.values())), ctx, memo)
        state = EntryState(EPOCH.value, unique, [names.get(id(t), "a lifted tensor") for t in unique], tuple(fixed),
                           tensor_guards(unique), unwritten, anchors)
        state.known = tuple(v for v, s in zip(fixed, self.fixed_sources) if s is not None)
        self.state = state
        return state

    def full_check(self) -> Callable[[list[Any], Any], bool]:
        """The generated predicate of every guard (built once; compile/function.py builds it with the entry, so
        the first call after a write to a watched object does not: ~40 ms for an 8-layer decoder)."""
        if self._full is None:
            self._full = compile_guards(self.guards)
        return self._full

    def admits(self, ctx: CallContext) -> tuple | None:
        """None when a guard fails; else the lifted inputs for this call, in placeholder order."""
        state = self.state
        if state is None or state.epoch != EPOCH.value or not state.unwritten():
            with DisableTorchFunction():
                if not self.full_check()(ctx.leaves, ctx.fn):
                    return None
            state = self.refresh(ctx)
            if state is None:
                return None
        values = self.held.run(self.always, ctx.leaves, ctx.fn, state.anchors)
        if values is False:
            return None
        # (state, deferred tensors, per-call inputs, lifted inputs, [whether the deferred tensors are among the per-call
        # ones, once asked]: instance_facts.py)
        last = self.held.recall(values)
        vouched = None
        if last is not None and last[0] is state:
            per_call, lifted, covered = last[2], last[3], last[4]
            if covered[0] is None:  # (asked on the memo's path only: a dynamic cache's values are new each call)
                covered[0] = self.aliases is not None and {id(v) for v in last[1]} <= {id(v) for v in per_call}
            # The aliasing memo's native pass over the per-call tensors (metadata and pointers as at the last call that
            # held, after its metadata check passed) implies this check where it covers the deferred tensors: one
            # pass over a static cache's 240 tensors at 80 layers, not two.
            vouched = self.aliases.remembered(per_call) if covered[0] else None
            if last[1] and vouched is None and not self.deferred.check(last[1]):
                return None
        else:
            per_call = self.deferred.admit(values, self.per_call_count)
            if per_call is None:
                return None
            lifted = None
        if not state.tensor_guard.check(*state.tensors):
            return None
        inputs = _tensors(ctx.leaves)
        spans = list(map(memory_span, inputs))  # (one storage lookup per input for both checks)
        if overlaps_fixed(inputs, state.fixed, state.bases, spans) != self.fixed_overlaps:
            return None
        if per_call:
            if self.aliases is not None and not self.aliases.holds(ctx.leaves, per_call, inputs, spans, vouched):
                return None
            if lifted is None:
                lifted = state.known + per_call if self._merge is None else self._merge(state.known, per_call)
                self.held.keep(values, (state, values[self.per_call_count:], per_call, lifted, [None]))
        else:
            lifted = state.fixed
        shapes = self.shapes
        if shapes is not None and not shapes.check(shapes.values(ctx.leaves[1:], lifted)):
            return None
        return lifted

    def replay(self, ctx: CallContext, outputs: list[Any]) -> None:
        """The capture's stores, after a call this entry admitted. Their targets start from the anchors
        (`cache.layers[<anchor>]`: no walk from the root per store) while EPOCH stays where the anchors were
        resolved; after a store that moved it (a replayed write to a watched module), from the root."""
        state = self.state
        epoch = state.epoch if state is not None and state.epoch == EPOCH.value and state.unwritten() else None
        anchored = AnchoredContext(ctx, state.anchors) if epoch is not None else None
        with DisableTorchFunction():
            done = 0
            if epoch is not None and self._replay is not None:  # (generated: replay_code.py)
                done = self._replay(ctx.leaves, ctx.fn, state.anchors, outputs, epoch)
            # Note: every value is read before the first store, as the program read it before storing (a swap,
            # `self.a, self.b = self.b, self.a`, stored both from the world the call began with; read per store,
            # the second read the first's store). The generated replay stores only outputs and constants.
            rest = self.effects[done:]
            values = [a.values_of(anchored, outputs) if EPOCH.value == epoch else r.values_of(ctx, outputs)
                      for a, r in rest]
            for (from_anchors, from_root), read in zip(rest, values):
                if EPOCH.value == epoch:
                    from_anchors.replay(anchored, outputs, read)
                else:
                    from_root.replay(ctx, outputs, read)

    def guard_code(self) -> str:
        """The source of the predicates that admit a call: the full check (run after a write to a watched object
        moved EPOCH) and the per-call one (then one C++ check of the protected tensors' metadata)."""
        from ..report import annotated

        return ("# the full check: after a write to a watched object\n" + annotated(self.full_check())
                + "\n\n# every call (then one C++ check of the metadata of the tensors it read)\n"
                + annotated(self.always))

    def key_for(self, key: CallKey, leaves: list[Any]) -> CallKey:
        """A call's key as this entry compares it: without the sizes its shape guards check."""
        if self.masked is None:
            return key
        return CallKey(without_sizes(key.fingerprint, leaves, self.masked), key.requires_grad)

    def why_not(self, ctx: CallContext, key: CallKey, labels: list[str]) -> str:
        if self.key is None:
            return "a write made objects its per-call check shared differ (the entry was dropped)"
        shapes = self.shapes
        if shapes is not None:
            key = self.key_for(key, ctx.leaves[1:])
            if key == self.key:
                try:
                    lifted = self.capture.placeholders_for_lifted(ctx)
                except StampoutError as e:  # an int captured as a symbol is not an int now
                    return str(e).splitlines()[0]
                values = shapes.values(ctx.leaves[1:], lifted)
                if not shapes.check(values):
                    return f"the symbolic capture assumed {shapes.why_not(values)}"
        if key != self.key:
            if key.fingerprint != self.key.fingerprint:
                return "inputs: " + describe_difference(self.key.fingerprint, key.fingerprint, labels)
            return "which inputs require grad differs"
        failure = first_failure(self.guards, ctx)
        if failure is not None:
            _, guard, actual = failure
            return (f"{guard.kind.value} of {guard.source.name()}: expected {guard.expected_text()}, "
                    f"got {actual} (read at {guard.where})")
        state = self.state
        if state is not None and not state.tensor_guard.check(*state.tensors):
            return str(state.tensor_guard.check_verbose(*state.tensors, tensor_check_names=state.names))
        if state is not None and overlaps_fixed(_tensors(ctx.leaves), state.fixed, state.bases) != self.fixed_overlaps:
            return "which inputs share memory with a parameter or buffer the program reads differs from the capture"
        if state is not None and self.aliases is not None:
            per_call = self.always(ctx.leaves, ctx.fn, state.anchors)
            if per_call:
                read = [self.capture.lifted[i][1].name() for i in self.per_call_positions]
                reason = self.aliases.why_not(ctx.leaves, labels, per_call, read)
                if reason is not None:
                    return reason
        return "no difference found"


def _merge_order(fixed: list[bool]) -> Callable[[tuple, tuple], Any] | None:
    """`merge(known, per_call)`: the lifted inputs in placeholder order from the fixed ones and those read per call
    (each group in placeholder order); None when that is the two concatenated. Generated: the fixed ones are put in
    placeholder order once per `known` tuple (made anew after each write: refresh), then each call stores the
    per-call ones into a copy (an 80-layer dynamic cache: 160 stores, where a gather of all 884 cost 8 us a call)."""
    known, per_call = iter(range(sum(fixed))), iter(range(sum(fixed), len(fixed)))
    order = [next(known) if is_fixed else next(per_call) for is_fixed in fixed]
    if order == list(range(len(fixed))):
        return None
    places = [i for i, is_fixed in enumerate(fixed) if not is_fixed]
    lines = ["def merge(known, per_call, _memo=[(None, None)]):",
             "    held = _memo[0]",
             "    if held[0] is not known:",  # (one tuple slot, replaced whole: threads read it unlocked)
             f"        held = _memo[0] = (known, list(_gather(known + (None,) * {len(places)})))",
             "    out = held[1].copy()",
             f"    ({''.join(f'out[{p}], ' for p in places)}) = per_call",
             "    return out"]
    namespace: dict[str, Any] = {"_gather": operator.itemgetter(*order)}
    exec(compile("\n".join(lines), "<stampout merge>", "exec"), namespace)
    return namespace["merge"]


class EagerEntry:
    """Calls with this key run the original function: its capture read something stampout cannot guard."""

    def __init__(self, key: CallKey, reason: str, pieces: Pieces | None = None,
                 only_while: Guard | None = None) -> None:
        self.key = key
        self.reason = reason
        self.capture = None
        self.masked = None
        self.pieces = pieces  # its children compiled (piecewise.py), or None: all of it runs eagerly
        # The reason holds only while this guard passes (a tensor it reads is its input): a call where it fails
        # captures again (and runs eagerly again, with an entry of its own, if the capture finds another reason).
        self._only_while = None if only_while is None else compile_guards([only_while])

    def admits(self, ctx: CallContext) -> bool:
        if self._only_while is None:
            return True
        with DisableTorchFunction():
            return bool(self._only_while(ctx.leaves, ctx.fn))

    def run(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        return fn(*args, **kwargs) if self.pieces is None else self.pieces.run(fn, args, kwargs)
