"""A region call during capture: fingerprint, look up, stamp out or trace, emit `invoke_subgraph`."""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from ..context import current, listeners
from ..errors import RegionError, message
from ..guards.guard import check_guards, first_failure
from ..sources import CallContext
from ..torch_internals import DisableTorchFunction
from ..trace.caught_kernel_errors import check_not_caught
from ..trace.frames import python_hooks_off, user_location
from ..trace.structure import aliases_of, flatten_inputs
from ..trace.tracer import Tracer
from ..watch.tracking import Watch
from ..watch.world_snapshot import Snapshot
from .branches import BranchFrames
from .cache import ArgInput, RegionCache, ReuseEntry, SourceInput, SymbolInput
from .events import Ineligible, Outcome, RegionEvent, RegionStats
from .fingerprint import describe_difference, fingerprint, leaf_key, requires_grad_pattern
from .frame import RegionFrame
from .hooks import CallHooks
from .marker import Region
from .stamp import Stamping
from .trace import Tracing

log = logging.getLogger("stampout.regions")


class RegionCalls(CallHooks, Tracing, Stamping, BranchFrames):
    """Handles every region call of one capture: looks it up, then stamps it out (stamp.py) or traces it
    (trace.py), with the hooks that show traced code to the open frames (hooks.py)."""

    def __init__(self, tracer: Tracer, cache: RegionCache, watch: Watch) -> None:
        self.tracer = tracer
        self.cache = cache
        self.watch = watch
        self.frames: list[RegionFrame] = []
        self.program: RegionFrame | None = None  # the whole program's frame, when compile guards it
        self.stats = RegionStats()
        self.events: list[RegionEvent] = []
        self._previous_trace: Any = None
        self._previous_profile: Any = None
        self.trace_hook = self._on_call  # one bound method, so `hooks_set` can tell it is ours
        self.profile_hook = self._on_c_call
        self.snapshot = Snapshot()  # what the user code it runs could reach, as it was (see world.py)
        self.stored: dict[int, Any] = {}  # objects stamped calls stored on (their traced values are made real)
        cache.generation += 1  # entries made by earlier captures (of a compiled function) may be evicted

    def call(self, region: Region, args: tuple, kwargs: dict) -> Any:
        # (stampout's own Python runs without the trace and profile functions: a stamped call stays cheap;
        # they are back on while a traced region's code runs)
        with python_hooks_off():
            ctx = current()
            if ctx is not None:  # (a stamped call runs no torch call that would see the user's `try`)
                check_not_caught(sys._getframe(1), ctx.root, f"the call of region {region.name}")
            self.tracer.builder.sync_inference(torch.is_inference_mode_enabled())  # (the call is an op too)
            return self._call(region, args, kwargs)

    def _call(self, region: Region, args: tuple, kwargs: dict) -> Any:
        with DisableTorchFunction():
            leaves, spec, labels = flatten_inputs(args, kwargs, region.arg_names)
            fp = fingerprint(spec, leaves)
            rg = requires_grad_pattern(leaves)
            ctx = CallContext(leaves, region.fn)
            site = user_location(3)
            if region.reuse_hash_fn is None:
                if self.tracer.symbols is not None and (region.code, fp) not in self.cache.by_fingerprint:
                    self.cache.rekey(region.code, lambda leaves: tuple(leaf_key(leaf) for leaf in leaves))
                for entry in self.cache.by_fingerprint.get((region.code, fp), ()):
                    if entry.rg_pattern is None or entry.rg_pattern == rg:
                        captured = self._holds(entry, ctx)
                        if captured is not False:
                            values = self._operands(entry, leaves, captured)
                            if aliases_of(values) == entry.operand_aliases and self._same_sizes_kind(entry, values):
                                return self._stamp(region, entry, leaves, values, site, rg)
                reason = self._miss_reason(region, fp, ctx, labels)
        if region.reuse_hash_fn is not None:
            return self._call_hashed(region, args, kwargs, leaves, labels, fp, rg, ctx, site)
        return self._trace(region, args, kwargs, leaves, labels, fp, rg, site, reason)

    def _holds(self, entry: ReuseEntry, ctx: CallContext) -> Any:
        """False, or the values of the entry's captured sources (resolved while checking its guards)."""
        with listeners(None, None):
            return check_guards(entry.check, ctx)

    def _same_sizes_kind(self, entry: ReuseEntry, values: list[Any]) -> bool:
        """An entry traced by another capture saw static sizes: it may not be handed a tensor this capture
        holds with symbolic sizes (its subgraph would have the other capture's sizes baked in). One that takes
        symbolic sizes as inputs names them by the other capture's symbols, which here name other sizes (`s27`:
        that capture's region input length, this one's program input length): it is traced again in this
        capture. (In this capture, held tensors of equal sizes share their symbols (duck sizing), and the
        entry's guards compared the concrete sizes: a stamped call gets the symbols its trace saw.)"""
        if entry.generation == self.cache.generation:
            return True
        if any(isinstance(spec, SymbolInput) for spec in entry.lifted):
            return False  # (its size inputs are symbols of the other capture's ShapeEnv: `s27` here is another size)
        dynamic = self.tracer.dynamic_tensors
        return not dynamic or not any(id(v) in dynamic for v in values)

    def _operands(self, entry: ReuseEntry, leaves: list[Any], captured: Any) -> list[Any]:
        it = iter(captured)
        symbols = self.tracer.symbols
        return [leaves[spec.index] if isinstance(spec, ArgInput)
                else symbols.value_of(spec.symbol) if isinstance(spec, SymbolInput) else next(it)
                for spec in entry.lifted]

    def _call_hashed(self, region, args, kwargs, leaves, labels, fp, rg, ctx, site) -> Any:
        # The key only picks among entries the user promised equivalent: what the hash function reads is no
        # guard (a traced call's own reads are, and the outer program's)
        with listeners(None, None):
            key = region.reuse_hash_fn(*args, **kwargs)
        if type(key) is not int:
            raise RegionError(message(
                f"reuse_hash_fn of region {region.name} returned {key!r} ({type(key).__name__}), not an int",
                site, "make reuse_hash_fn return an int computed from the arguments",
            ))
        entry = self.cache.hashed.get((region.code, key))
        if entry is not None:
            if entry.fingerprint != fp:
                raise RegionError(message(
                    f"region {region.name}: two calls with reuse_hash_fn key {key} have different inputs: "
                    + describe_difference(entry.fingerprint, fp, labels),
                    site, "include what differs in the hash key, or drop reuse_hash_fn",
                ))
            with DisableTorchFunction():
                memo: dict = {}
                captured = [spec.source.resolve(ctx, memo) for spec in entry.lifted if isinstance(spec, SourceInput)]
                values = self._operands(entry, leaves, captured)
            if aliases_of(values) != entry.operand_aliases:
                raise RegionError(message(
                    f"region {region.name}: two calls with reuse_hash_fn key {key} differ in which tensors "
                    "they read are the same tensor (tied weights?)",
                    site, "include the difference in the hash key, or drop reuse_hash_fn",
                ))
            with DisableTorchFunction():
                return self._stamp(region, entry, leaves, values, site, rg)
        return self._trace(region, args, kwargs, leaves, labels, fp, rg, site,
                           f"first call with reuse_hash_fn key {key}", hash_key=key)

    def _miss_reason(self, region: Region, fp: tuple, ctx: CallContext, labels: list[str]) -> str:
        entries = self.cache.entries.get(region.code, [])
        if not entries:
            return "first call"
        same = self.cache.by_fingerprint.get((region.code, fp), [])
        if not same:
            return "inputs differ: " + describe_difference(entries[-1].fingerprint, fp, labels)
        best = None
        with listeners(None, None):
            for entry in same:
                failure = first_failure(entry.guards, ctx)
                if failure is not None and (best is None or failure[0] > best[0]):
                    best = failure
        if best is None:
            return ("the trace read requires_grad, and which inputs require grad differs, or the tensors it "
                    "reads alias each other differently (tied weights)")
        _, guard, actual = best
        return (f"guard failed: {guard.kind.value} of {guard.source.name()}: expected {guard.expected_text()}, "
                f"got {actual} (read at {guard.where})")

    def _check_cap(self, region: Region, reason: str, site: str) -> bool:
        """One more entry than `max_reuse_entries` in this capture is an error (for a region marked by
        regions="auto": the call stays traced, without an entry); entries left by earlier captures of a
        compiled function make room instead, oldest first. True when the entry may be added."""
        entries = self.cache.entries.get(region.code, [])
        count = sum(e.generation == self.cache.generation for e in entries)
        while len(entries) >= region.max_reuse_entries and count < len(entries):
            self.cache.evict(region.code, next(e for e in entries if e.generation != self.cache.generation))
        if count >= region.max_reuse_entries and region.automatic:
            log.info("region %s (marked by regions='auto') has %d entries; this call stays traced: %s",
                     region.name, count, reason)
            return False
        if count >= region.max_reuse_entries:
            raise RegionError(message(
                f"region {region.name} needs a new trace but already has max_reuse_entries={region.max_reuse_entries}"
                f" entries; what keeps differing between calls: {reason}",
                site,
                "make the calls equivalent (pass differing values as tensors), raise max_reuse_entries, "
                "or remove the region marker",
            ))
        return True

    def _record(self, region: Region, site: str, outcome: Outcome, reason: str, subgraph: str,
                ineligible: tuple[Ineligible, ...] = ()) -> None:
        event = RegionEvent(region.name, site, outcome, reason, subgraph, ineligible)
        self.stats.count_ineligible(ineligible)
        self.events.append(event)
        if log.isEnabledFor(logging.DEBUG) or (outcome is not Outcome.REUSED and log.isEnabledFor(logging.INFO)):
            text = f"region {region.name} at {site}: {outcome}"
            if reason and outcome is not Outcome.REUSED:
                text += f" ({reason})"
            if ineligible:
                text += f"; not reusable: {event.ineligible}"
            log.debug(text) if outcome is Outcome.REUSED else log.info(text)


