"""Tracing a region call: a subgraph built while its code runs, closed into a reuse entry (outputs, escaped
tensors, stores a stamped call repeats) and emitted into the parent graph as an `invoke_subgraph`."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.fx as fx

from ..context import current, listeners
from ..errors import RegionError, message
from ..guards.entry import compile_entry_guards
from ..guards.guard import is_constant
from ..sources import MISSING, Absolute, Input
from ..torch_internals import DisableTorchFunction, LazyGraphModule, without_module_hooks
from ..trace.builder import Builder
from ..trace.frames import swallowed, user_location
from ..trace.names import identifier
from ..trace.structure import template_constants, tensors_within, to_template
from ..trace.tensormeta import output_meta
from .cache import ArgInput, Output, ReuseEntry, SourceInput, Store, SymbolInput
from .events import Outcome
from .frame import RegionFrame
from .objects import program_fields
from .views import views_of_one_base


class Tracing:
    """Tracing a region call into a subgraph and a reuse entry (a part of RegionCalls)."""

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
        ctx = current()
        raised = len(ctx.raised) if ctx is not None else 0
        try:
            with listeners(self.on_read, self.on_write):
                sys.settrace(self.trace_hook)
                sys.setprofile(self.profile_hook)
                try:
                    out = region.fn(*args, **kwargs)
                finally:
                    sys.setprofile(None)
                    sys.settrace(None)
            caught = swallowed(ctx, raised)
            if caught is not None:  # (its trace took the path of an `except` eager would not take: never reused)
                frame.mark_ineligible("catches an error stampout raised while tracing it: "
                                      + (str(caught).strip().splitlines() or [type(caught).__name__])[0])
        except BaseException:
            if frame.slots is not None:
                frame.slots.close()  # stop following per-layer indices (the trace failed)
            raise
        finally:
            self.pop()
            tracer.builders.pop()
            self.snapshot.note_cells_read(frame.cells_read)  # (closures first reached in it: user state too)
        with DisableTorchFunction():
            return self._finish_trace(region, frame, child, parent, out, fp, rg, site, reason, hash_key)

    def _finish_trace(self, region, frame, child, parent, out, fp, rg, site, reason, hash_key) -> Any:
        """Close the subgraph, dedup it, make the reuse entry and emit the call into the parent graph."""
        frame.close()
        holes: list[torch.Tensor] = []
        template = to_template(out, holes)
        tagged = [k for t in holes if isinstance(t, torch.Tensor) for k in program_fields(getattr(t, "__dict__", None))]
        if tagged:  # (a stamped call's outputs are new tensors)
            frame.mark_ineligible(f"sets Python attributes on an output tensor (.{tagged[0]})")
        hole_nodes = [child.node_for(t) for t in holes]
        placeholders = {n: i for i, n in enumerate(n for n in child.graph.nodes if n.op == "placeholder")}
        outputs: list[tuple[Output, int]] = []
        returned: list[fx.Node] = []
        for node in hole_nodes:
            if node in placeholders:
                outputs.append((Output.IN, placeholders[node]))
            elif node in returned:
                outputs.append((Output.OUT, returned.index(node)))
            else:
                outputs.append((Output.OUT, len(returned)))
                returned.append(node)
        self.snapshot.clear_caches(frame.cache_misses, child.nodes)  # (its traced values: see Note: functools caches)
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
        holes.extend(escaped)
        stores = self._replayable_stores(frame, child, holes)
        if stores and hash_key is not None:  # calls sharing a hash key skip the guards a replay relies on
            frame.mark_ineligible(f"writes {stores[0][0].name()}.{stores[0][1]} (a Python side effect)")
        returned, outputs = views_of_one_base(returned, outputs, holes)
        child.sync_inference()
        child.graph.output(tuple(returned))
        gm = without_module_hooks(LazyGraphModule(child.submodules, child.graph, class_name="Region"))
        name, gm, deduped = self.cache.register(gm, fp.state)

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
            captured = [s.source for s in frame.lifted if isinstance(s, SourceInput)]
            entry.check = compile_entry_guards(frame.guards, captured)
            self.cache.add(region.code, entry)
            if hash_key is not None:
                self.cache.hashed[(region.code, hash_key)] = entry
        elif hash_key is not None:
            raise RegionError(message(
                f"region {region.name} has a reuse_hash_fn but its trace cannot be reused: {frame.ineligible[0]}",
                site, "remove the side effect or the reuse_hash_fn",
            ))

        self._emit(parent, entry, child.operands, holes, [n.meta["val"] for n in returned])
        outcome = Outcome.DEDUPED if deduped else Outcome.TRACED
        if deduped:
            self.stats.dedups += 1
        else:
            self.stats.traces += 1
        self._record(region, site, outcome, reason, name, tuple(frame.ineligible))
        return out

    @staticmethod
    def _replayable_stores(frame: RegionFrame, child: Builder, holes: list) -> tuple:
        """The trace's attribute stores on objects it can name (`cache.layers[i].keys = zeros(...)`, a flag set
        to True), as stores its stamped calls repeat: the last value per attribute, a constant, a tensor the
        region returns (an escaped output) or one of its inputs. Anything else makes the trace ineligible."""
        if frame.program or not frame.stores:
            return ()
        placeholders = {n: i for i, n in enumerate(n for n in child.graph.nodes if n.op == "placeholder")}
        hole_of = {id(t): k for k, t in enumerate(holes)}
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
            elif isinstance(value, torch.Tensor) and id(value) in hole_of:
                how = (Store.HOLE, hole_of[id(value)])
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
