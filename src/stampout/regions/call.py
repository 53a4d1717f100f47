"""A region call during capture: fingerprint, look up, stamp out or trace, emit `invoke_subgraph`."""

from __future__ import annotations

import logging
import operator
import os
import sys
import types
from typing import Any

import torch
import torch.fx as fx

from ..builder import Builder, map_tensors
from ..context import listeners
from ..errors import RegionError, message
from ..frames import caller_outside_torch, python_hooks_off, set_profile, user_location
from ..guards import check_guards, compile_guards, first_failure, is_constant
from ..names import identifier
from ..runner import as_call_modules
from ..sources import MISSING, Absolute, CallContext, Input
from ..structure import aliases_of, build, flatten_inputs, template_constants, tensors_within, to_template
from ..torch_internals import DisableTorchFunction, FakeTensor, LazyGraphModule, invoke_subgraph, without_module_hooks
from ..tracer import Tracer
from ..tracking import Watch
from ..world_snapshot import Snapshot
from .cache import ArgInput, Output, RegionCache, ReuseEntry, SourceInput, Store, SymbolInput
from .code import code_facts, is_user_code
from .events import Ineligible, Outcome, RegionEvent, RegionStats
from .fingerprint import describe_difference, fingerprint, leaf_key, requires_grad_pattern
from .frame import RegionFrame
from .marker import Region
from .purity import impure_call, location, torch_state_call, user_caller, watched_file
from .views import output_meta, views_of_one_base

log = logging.getLogger("stampout.regions")
_NN_MODULES = os.path.dirname(torch.nn.modules.__file__) + os.sep  # nn.GELU.forward reads F.gelu: guarded too


class RegionCalls:
    """Handles every region call of one capture."""

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

    def hooks_set(self) -> bool:
        return sys.gettrace() is self.trace_hook or sys.getprofile() is self.profile_hook

    # ---- entry point ------------------------------------------------------------------------
    def call(self, region: Region, args: tuple, kwargs: dict) -> Any:
        # (stampout's own Python runs without the trace and profile functions: a stamped call stays cheap;
        # they are back on while a traced region's code runs)
        with python_hooks_off():
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

    def note_root_lift(self, t: torch.Tensor) -> None:
        """The outer graph lifted a tensor; a program frame must be able to name it to guard it."""
        program = self.program
        if program is not None and id(t) not in program.sources and not program.leaves_contain(t):
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

    def note_hook(self, reason: str) -> None:
        """The program registers an autograd hook: a reused trace would register the traced call's function,
        and a compiled program runs eagerly (AOTAutograd backends do not keep the registration)."""
        for frame in self.frames:
            frame.mark_ineligible(reason)

    def note_unguarded_read(self, reason: str) -> None:
        """The program read state no guard sees (`p.grad`, `x._version`): no open frame's trace is reusable."""
        for frame in self.frames:
            frame.mark_ineligible(reason)

    def frame_ids(self) -> frozenset[int]:
        return frozenset(id(f) for f in self.frames)

    # ---- frames and the profile hook that shows them the Python code that runs -----------------------
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
        if watched_file(frame.f_code.co_filename):
            what = impure_call(arg)
            caller = user_caller(frame) if what is not None else None
        else:  # (torch's Python reseeding its generator or setting autograd hooks for the user)
            what = torch_state_call(arg, frame)
            caller = caller_outside_torch(frame) if what is not None else None
        if caller is not None:
            reason = f"calls {what}, which is not known to be pure (at {location(caller)})"
            for f in self.frames:
                if watched_file(frame.f_code.co_filename):
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
                        f.on_code(code, g)
        elif event == "call" and self.frames and code.co_filename.startswith(_NN_MODULES):
            g = frame.f_globals
            with DisableTorchFunction(), listeners(None, None):
                for f in self.frames:
                    f.on_library_code(code, g)
        return local

    def note_autograd_read(self) -> None:
        """The code being traced read `requires_grad` (or similar): its traces depend on it."""
        for frame in self.frames:
            frame.reads_requires_grad = True

    def _holds(self, entry: ReuseEntry, ctx: CallContext) -> Any:
        """False, or the values of the entry's captured sources (resolved while checking its guards)."""
        with listeners(None, None):
            return check_guards(entry.check, ctx)

    def _same_sizes_kind(self, entry: ReuseEntry, values: list[Any]) -> bool:
        """An entry traced by another capture saw static sizes: it may not be handed a tensor this capture
        holds with symbolic sizes (its subgraph would have the other capture's sizes baked in). (In this
        capture, held tensors of equal sizes share their symbols (duck sizing), and the entry's guards compared
        the concrete sizes: a stamped call gets the symbols its trace saw.)"""
        dynamic = self.tracer.dynamic_tensors
        return not dynamic or entry.generation == self.cache.generation or not any(id(v) in dynamic for v in values)

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

    # ---- misses -----------------------------------------------------------------------------
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

    # ---- tracing ------------------------------------------------------------------------------
    def _trace(self, region, args, kwargs, leaves, labels, fp, rg, site, reason, hash_key=None) -> Any:
        tracer = self.tracer
        parent = tracer.builder
        with DisableTorchFunction():
            frame = RegionFrame(region.fn, leaves, labels, self.watch)
            frame.cache_misses = self.snapshot.cache_misses()
            frame.world_state = self.snapshot.state()
            for i, arg in enumerate(args):
                frame.note_input_containers(
                    arg, Input(i, region.arg_names[i] if i < len(region.arg_names) else f"args[{i}]"))
            for k, arg in kwargs.items():
                frame.note_input_containers(arg, Input(k, k))
            child = Builder(tracer, parent, frame)
            for i, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor) and id(leaf) not in child.nodes:
                    child.operands.append(parent.node_for(leaf))
                    child.placeholder(identifier(labels[i]), leaf)
                    frame.lifted.append(ArgInput(i))
            for outer in self.frames:  # what the nested region's code reads, its callers' traces read too
                outer.adopt_function(region.fn, Absolute(region.fn, region.name))
        tracer.builders.append(child)
        self.push(frame)
        try:
            with listeners(self.on_read, self.on_write):
                sys.settrace(self.trace_hook)
                sys.setprofile(self.profile_hook)
                try:
                    out = region.fn(*args, **kwargs)
                finally:
                    sys.setprofile(None)
                    sys.settrace(None)
        except BaseException:
            if frame.slots is not None:
                frame.slots.close()  # stop following per-layer indices (the trace failed)
            raise
        finally:
            self.pop()
            tracer.builders.pop()
        with DisableTorchFunction():
            return self._finish_trace(region, frame, child, parent, out, fp, rg, site, reason, hash_key)

    def _finish_trace(self, region, frame, child, parent, out, fp, rg, site, reason, hash_key) -> Any:
        """Close the subgraph, dedup it, make the reuse entry and emit the call into the parent graph."""
        frame.close()
        slots: list[torch.Tensor] = []
        template = to_template(out, slots)
        slot_nodes = [child.node_for(t) for t in slots]
        placeholders = {n: i for i, n in enumerate(n for n in child.graph.nodes if n.op == "placeholder")}
        outputs: list[tuple[Output, int]] = []
        returned: list[fx.Node] = []
        for node in slot_nodes:
            if node in placeholders:
                outputs.append((Output.IN, placeholders[node]))
            elif node in returned:
                outputs.append((Output.OUT, returned.index(node)))
            else:
                outputs.append((Output.OUT, len(returned)))
                returned.append(node)
        self.snapshot.clear_caches(frame.cache_misses)  # (a cache is transparent: later calls compute again)
        changed = self.snapshot.changed_since(frame.world_state)
        if changed:  # a stamped call runs no Python: it would not change them
            frame.mark_ineligible(f"changes {changed[0]} (state outside its arguments that a stamped call would "
                                  "not change)")
        places = [*template_constants(template), *(c[0] for c in frame.containers), *(s[2] for s in frame.stores)]
        escaped = self._escaped(child, places, returned)
        hidden = [t for t in self._escaped(child, self.snapshot.contents(), returned)
                  if not any(t is e for e in escaped)]
        if hidden:  # kept by a memo dict or list the guards do not watch (a class attribute's)
            frame.mark_ineligible(f"keeps a tensor of shape {tuple(hidden[0].shape)} it computed in Python state "
                                  "outside its arguments (a memo dict or list)")
            escaped.extend(hidden)
        for t in escaped:  # tensors the region handed out by side channels: outputs too
            outputs.append((Output.OUT, len(returned)))
            returned.append(child.nodes[id(t)][1])
        slots.extend(escaped)
        stores = self._replayable_stores(frame, child, slots)
        if stores and hash_key is not None:  # calls sharing a hash key skip the guards a replay relies on
            frame.mark_ineligible(f"writes {stores[0][0].name()}.{stores[0][1]} (a Python side effect)")
        returned, outputs = views_of_one_base(returned, outputs, slots)
        child.sync_inference()
        child.graph.output(tuple(returned))
        gm = without_module_hooks(LazyGraphModule(child.submodules, child.graph, class_name="Region"))
        name, gm, deduped = self.cache.register(gm, fp[2])

        for value in template_constants(template):
            if not is_constant(value):
                frame.mark_ineligible(f"returns a {type(value).__name__} (outputs must be tensors and constants)")
        out_meta = {rg: [output_meta(n.meta["val"]) for n in returned]}
        entry = ReuseEntry(
            region=region.name, fingerprint=fp, guards=frame.guards, check=None, lifted=frame.lifted, subgraph=name,
            gm=gm, outputs=outputs, template=template, out_meta=out_meta, n_outputs=len(returned),
            rg_pattern=rg if frame.reads_requires_grad else None, operand_aliases=tuple(range(len(frame.lifted))),
            call_site=site, generation=self.cache.generation,
            leaves=frame.leaves if self.tracer.symbols is not None else None, stores=stores)
        if not frame.ineligible and (hash_key is not None or self._check_cap(region, reason, site)):
            entry.check = compile_guards(frame.guards, [s.source for s in frame.lifted if isinstance(s, SourceInput)])
            self.cache.add(region.code, entry)
            if hash_key is not None:
                self.cache.hashed[(region.code, hash_key)] = entry
        elif hash_key is not None:
            raise RegionError(message(
                f"region {region.name} has a reuse_hash_fn but its trace cannot be reused: {frame.ineligible[0]}",
                site, "remove the side effect or the reuse_hash_fn",
            ))

        self._emit(parent, entry, child.operands, slots, [n.meta["val"] for n in returned])
        outcome = Outcome.DEDUPED if deduped else Outcome.TRACED
        if deduped:
            self.stats.dedups += 1
        else:
            self.stats.traces += 1
        self._record(region, site, outcome, reason, name, tuple(frame.ineligible))
        return out

    @staticmethod
    def _replayable_stores(frame: RegionFrame, child: Builder, slots: list) -> tuple:
        """The trace's attribute stores on objects it can name (`cache.layers[i].keys = zeros(...)`, a flag set
        to True), as stores its stamped calls repeat: the last value per attribute, a constant, a tensor the
        region returns (an escaped output) or one of its inputs. Anything else makes the trace ineligible."""
        if frame.program or not frame.stores:
            return ()
        placeholders = {n: i for i, n in enumerate(n for n in child.graph.nodes if n.op == "placeholder")}
        slot_of = {id(t): k for k, t in enumerate(slots)}
        last: dict[tuple[int, str], tuple] = {}
        for obj, name, value, _, where in frame.stores:
            last[(id(obj), name)] = (obj, name, value, where)
        stores = []
        for obj, name, value, where in last.values():
            target = frame.sources.get(id(obj))
            hit = child.nodes.get(id(value)) if isinstance(value, torch.Tensor) else None
            if target is None:
                return ()  # (already ineligible: see RegionFrame.on_write)
            if value is MISSING:
                how = (Store.MISSING, None)
            elif is_constant(value) and type(value) not in (list, dict, set) or isinstance(value, torch.SymInt):
                how = (Store.CONST, value)  # (a symbolic int: a stamped call, with the same symbols, stores the same)
            elif hit is not None and hit[1] in placeholders:
                how = (Store.OPERAND, placeholders[hit[1]])
            elif isinstance(value, torch.Tensor) and id(value) in slot_of:
                how = (Store.SLOT, slot_of[id(value)])
            else:
                frame.mark_ineligible(f"stores a {type(value).__name__} on {target.name()}.{name} at {where}")
                return ()
            stores.append((target, name, how))
        return tuple(stores)

    @staticmethod
    def _escaped(child: Builder, places: list[Any], returned: list[fx.Node]) -> list[torch.Tensor]:
        """Tensors computed in the region that leave it other than as outputs, found in `places`: inside a
        returned object, appended to a container it was given, stored on an object."""
        found: dict[int, torch.Tensor] = {}
        for t in tensors_within(places):
            hit = child.nodes.get(id(t))
            if hit is not None and hit[1].op != "placeholder" and hit[1] not in returned:
                found[id(t)] = t
        return list(found.values())

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

    # ---- stamping -----------------------------------------------------------------------------
    def _stamp(self, region: Region, entry: ReuseEntry, leaves: list[Any], values: list[Any], site: str,
               rg: tuple) -> Any:
        parent = self.tracer.builder
        for frame in self.frames:
            frame.import_entry(entry, leaves, region.fn, values)
        operands = [parent.node_for(v) for v in values]
        out_meta = entry.out_meta.get(rg)
        if out_meta is None:
            out_meta = entry.out_meta[rg] = self._propagate(entry, values)
        fakes = [self._fake(meta) for meta in out_meta]
        slots = []
        for kind, i, *view in entry.outputs:
            if kind is Output.VIEW:  # a view of output i
                slots.append(torch.as_strided(fakes[i], *view))
            elif kind is Output.IN_VIEW:  # a view of operand i, at the same place relative to it
                size, stride, relative = view
                base = values[i] if isinstance(values[i], FakeTensor) else self.tracer.fake_of(values[i])
                slots.append(torch.as_strided(base, size, stride, base.storage_offset() + relative))
            else:
                slots.append(fakes[i] if kind is Output.OUT else values[i])
        self._emit(parent, entry, operands, slots, fakes)
        if entry.stores:
            self._repeat_stores(entry, CallContext(leaves, region.fn), slots, values)
        self.stats.reuses += 1
        self._record(region, site, Outcome.REUSED, "", entry.subgraph)
        return build(entry.template, slots)

    def _repeat_stores(self, entry: ReuseEntry, ctx: CallContext, slots: list, values: list) -> None:
        """What the traced call stored, stored by this stamped call on its own objects (through their
        `__setattr__`, so enclosing traces and the program see the writes; `stored` keeps the objects, whose
        traced values the capture then makes real as it does the traced call's)."""
        memo: dict = {}
        for target, name, (kind, value) in entry.stores:
            obj = target.resolve(ctx, memo)
            self.stored[id(obj)] = obj
            if kind is Store.MISSING:
                if hasattr(obj, name):
                    delattr(obj, name)
                continue
            setattr(obj, name, value if kind is Store.CONST else slots[value] if kind is Store.SLOT else values[value])

    def _propagate(self, entry: ReuseEntry, values: list[Any]) -> list[tuple]:
        """Output metadata of the entry's subgraph for inputs that differ only in requires_grad (its nested region
        calls run as their subgraphs: invoke_subgraph refuses gradients through one that writes its inputs)."""
        inputs = [self.tracer.fake_of(v) if isinstance(v, torch.Tensor) else v for v in values]
        outs = fx.Interpreter(as_call_modules(entry.gm)).run(*inputs)
        return [output_meta(t) for t in outs]

    def _fake(self, meta: tuple) -> torch.Tensor:
        """An output of a stamped call: computed by it, so (like the traced call's) it stands for no autograd
        leaf when it requires grad — in-place ops on it work as on the meta path's outputs (MetaRunner.mutate),
        without a clone through the fake mode (~150 us a stamped layer)."""
        fake = self.tracer.new_fake(*meta)
        if fake.requires_grad:
            self.tracer.meta.adopt(fake)
        return fake

    def _emit(self, builder: Builder, entry: ReuseEntry, operands: list[fx.Node], slots: list,
              out_fakes: list) -> None:
        """Append `invoke_subgraph(subgraph, name, *operands)`, one getitem per output, and the views the
        region returned of one of them, to `builder`."""
        builder.submodules[entry.subgraph] = entry.gm
        graph = builder.graph
        sub = graph.get_attr(entry.subgraph)
        call = invoke_subgraph(graph, sub, entry.subgraph, operands)
        outs = [graph.call_function(operator.getitem, (call, i)) for i in range(entry.n_outputs)]
        call.meta["stack_trace"] = f"  File {entry.call_site}\n"
        for out, fake in zip(outs, out_fakes):
            out.meta["val"] = fake
        for (kind, i, *view), value in zip(entry.outputs, slots):
            if kind is Output.OUT:
                builder.bind(value, outs[i])
            elif kind is Output.VIEW:
                node = graph.call_function(torch.as_strided, (outs[i], *map_tensors(view, builder.node_for, True)))
                node.meta["val"] = value
                builder.bind(value, node)
            elif kind is Output.IN_VIEW:
                where = (view[0], view[1], value.storage_offset())
                node = graph.call_function(torch.as_strided,
                                           (operands[i], *map_tensors(where, builder.node_for, True)))
                node.meta["val"] = value
                builder.bind(value, node)
        for out, fake in zip(outs, out_fakes):
            builder.bind(fake, out)
        call.meta["val"] = tuple(out_fakes)

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

    # ---- lifting into a region's subgraph -------------------------------------------------------
    def lift_symbol(self, builder: Builder, symbol: Any) -> fx.Node:
        """A symbolic size the region's code uses: an int input of its subgraph (a bound symbol), passed by
        the caller, so one subgraph serves every size."""
        value = self.tracer.symbols.value_of(symbol)
        builder.operands.append(builder.parent.size_node(value))
        builder.frame.lifted.append(SymbolInput(symbol))
        return builder.symbol_placeholder(symbol, value)

    def lift_into_subgraph(self, builder: Builder, t: torch.Tensor) -> fx.Node:
        frame: RegionFrame = builder.frame
        source = frame.sources.get(id(t))
        if source is None:
            frame.mark_ineligible(
                f"uses a tensor of shape {tuple(t.shape)} that is not reachable from its arguments, closures "
                f"or globals (at {user_location(4)})"
            )
            label = "captured"
        else:
            label = source.name()
        operand = builder.parent.node_for(t)
        builder.operands.append(operand)
        frame.lifted.append(SourceInput(source))
        return builder.placeholder(identifier(label), t)


