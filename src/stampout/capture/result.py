"""`Capture`: a captured program — its GraphModule, how to feed it, and what happened to its regions."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..backends.runner import as_call_modules
from ..errors import StampoutError, message
from ..regions.events import RegionEvent, RegionStats
from ..regions.fingerprint import LeafKind, as_leaf_key, leaf_key, show_leaf_key
from ..report import explain_text, guard_code_text
from ..sources import MISSING, CallContext, Source
from ..trace.frames import user_location
from ..trace.shapes import has_symbols
from ..trace.structure import Template, aliases_of, build, flatten_inputs


@dataclass(repr=False)
class Capture:
    """A captured program. Call it like the original; `gm` is the graph it runs.

    Example::

        cap = stampout.capture(model, x)
        y = cap(x)            # equals model(x), with model's live parameters
        print(cap.stats)      # traces=1 reuses=31 dedups=0 subgraphs=1
    """

    graph_module: fx.GraphModule
    input_spec: tuple
    input_tensor_leaves: list[int]  # which flat input leaves are placeholders, in order
    input_aliases: tuple[int, ...]  # which input leaves were the same object at capture
    lifted: list[tuple[torch.Tensor, Source | None]]  # the other placeholders, in order: the tensor seen at
    # capture and the source each call reads it from (relative to `[fn, *flat inputs]`; None: unnamed)
    output_template: Template
    stats: RegionStats = field(default_factory=RegionStats)
    events: list[RegionEvent] = field(default_factory=list)
    fn: Any = None  # what was captured (a module, function or bound method)
    frame_fn: Any = None  # the Python function whose closures and globals the program reads
    program: Any = None  # the RegionFrame of the whole program (compile only): its guards and side effects
    effects: Any = None  # effects.Plan (compile only): stores to replay after each call, from extra outputs
    fill_meta: Any = None  # fills deferred placeholder metadata on first use of `gm`
    shapes: Any = None  # shapes.ShapeGuards of a capture with symbolic sizes: what it assumed about them
    stores: list = field(default_factory=list)  # (capture only) (holder source | None, key, Place,
    # effects.Value): what the program stored on its input objects (a KV cache), stored on each call's objects
    unreplayable: str = ""  # (capture only) a change to the input objects that calls cannot repeat
    reuse_entries: list = field(default_factory=list)  # the region reuse entries this capture made (guard_code)
    # (capture only) the fingerprint's leaf_key of each input leaf that was no tensor (a constant, None, a module,
    # an object): baked into the graph, so a call must pass the same (see `note_constants`)
    input_keys: tuple[tuple[int, tuple], ...] = ()
    input_objects: tuple[tuple[int, Any], ...] = ()  # (capture only) input objects the graph holds as constants
    _runner: fx.GraphModule | None = None

    @property
    def gm(self) -> fx.GraphModule:
        """The captured graph: user tensor inputs, then parameters and buffers, as placeholders."""
        if self.fill_meta is not None:
            self.fill_meta()
            self.fill_meta = None
        return self.graph_module

    def fake_inputs(self) -> list[Any]:
        """The capture's own fake values of `gm`'s placeholders (symbolic sizes where it captured them so)."""
        return [n.meta["val"] for n in self.gm.graph.nodes if n.op == "placeholder"]

    def placeholders_for(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The real tensors for `gm`'s placeholders: the call's tensors, then live parameters and buffers."""
        leaves, spec, labels = flatten_inputs(args, kwargs)
        if spec != self.input_spec or aliases_of(leaves) != self.input_aliases:
            raise StampoutError(message(
                "the call's input structure differs from the captured one"
                + ("" if spec != self.input_spec else " (which inputs are the same tensor)"),
                user_location(),
                "call with the same argument structure as at capture, or capture again",
            ))
        values = [leaves[i] for i in self.input_tensor_leaves]
        for i, v in zip(self.input_tensor_leaves, values):
            if not isinstance(v, torch.Tensor):
                raise StampoutError(message(
                    f"input {labels[i]} was a tensor at capture and is {type(v).__name__} now",
                    user_location(), "pass a tensor, or capture again",
                ))
        return values + self.placeholders_for_lifted(CallContext([self.fn, *leaves], self.frame_fn))

    def placeholders_for_lifted(self, ctx: CallContext) -> list[torch.Tensor]:
        """The live tensors behind the lifted placeholders (parameters, buffers, tensor attributes, tensors
        held by input objects), resolved in the call context `ctx`."""
        values: list[torch.Tensor] = []
        memo: dict[Source, Any] = {}
        for tensor, source in self.lifted:
            if source is None:
                values.append(tensor)
                continue
            value = source.resolve(ctx, memo)
            if type(value) is int and isinstance(tensor, torch.SymInt):
                values.append(value)  # an int attribute captured as a symbol
                continue
            if not isinstance(value, torch.Tensor):
                got = "nothing" if value is MISSING else type(value).__name__
                was = "an int" if isinstance(tensor, torch.SymInt) else "a tensor"
                raise StampoutError(message(
                    f"{source.name()} was {was} at capture and is {got} now",
                    user_location(), "capture again after changing the model's structure",
                ))
            values.append(value)
        return values

    def check_inputs(self, values: list[torch.Tensor]) -> None:
        """Raise when a placeholder's tensor differs in metadata from the one the graph was captured with."""
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for node, value in zip(placeholders, values):
            expected = node.meta.get("val")
            if expected is None or not isinstance(value, torch.Tensor):
                continue
            if has_symbols(expected):
                continue  # checked below, against what the capture assumed about its sizes
            want = (tuple(expected.shape), expected.stride(), expected.dtype, expected.device)
            got = (tuple(value.shape), value.stride(), value.dtype, value.device)
            if want != got:
                raise StampoutError(message(
                    f"input {node.name} differs from the captured one: expected shape={list(want[0])}, "
                    f"stride={list(want[1])}, dtype={want[2]}, device={want[3]}; got shape={list(got[0])}, "
                    f"stride={list(got[1])}, dtype={got[2]}, device={got[3]}",
                    user_location(), "capture again for these inputs (or use stampout.compile, which recaptures)",
                ))
        if self.shapes is not None:
            by_leaf = dict(zip(self.input_tensor_leaves, values))
            dynamic = self.shapes.values(by_leaf, values[len(self.input_tensor_leaves):])
            if not self.shapes.check(dynamic):
                raise StampoutError(message(
                    f"the inputs' sizes break what the capture assumed about them: {self.shapes.why_not(dynamic)} "
                    f"is false for sizes {[list(t.shape) for t in dynamic]} (all assumptions: "
                    f"{self.shapes.describe()})",
                    user_location(), "capture again for these inputs (or use stampout.compile, which recaptures)",
                ))

    def note_constants(self, leaves: list[Any]) -> None:
        """Keep the key of each input leaf that is no tensor (the capture's inputs, flattened before it ran), and
        which input objects the graph holds as constants (a `torch.Generator` its random ops draw from)."""
        self.input_keys = tuple((i, leaf_key(leaf)) for i, leaf in enumerate(leaves)
                                if not isinstance(leaf, torch.Tensor))
        objects = [i for i, key in self.input_keys if as_leaf_key(key).kind is LeafKind.OBJECT]
        if not objects:  # (the common case: no walk of the graphs)
            return
        held = {id(operator.attrgetter(n.target)(m)) for m in self.graph_module.modules()
                if isinstance(m, fx.GraphModule) for n in m.graph.find_nodes(op="get_attr")}
        self.input_objects = tuple((i, leaves[i]) for i in objects if id(leaves[i]) in held)

    def _check_constants(self, leaves: list[Any], labels: list[str]) -> None:
        for i, key in self.input_keys:
            got = leaf_key(leaves[i])
            if got != key:
                raise StampoutError(message(
                    f"input {labels[i]} differs from the captured one: expected {show_leaf_key(key)}, got "
                    f"{show_leaf_key(got)} (the capture baked it into the graph)", user_location(),
                    "capture again for this value, or use stampout.compile, which captures once per value"))
        for i, obj in self.input_objects:
            if leaves[i] is not obj:
                raise StampoutError(message(
                    f"input {labels[i]} is another {type(obj).__qualname__} than the captured one (the graph "
                    f"holds the captured object itself: {obj!r:.80})", user_location(),
                    "pass the object the capture was given, capture again for this one, or use stampout.compile"))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._runner is None:
            self._runner = as_call_modules(self.gm)
        values = self.placeholders_for(args, kwargs)
        leaves, _, labels = flatten_inputs(args, kwargs)
        if self.input_keys:
            self._check_constants(leaves, labels)
        self.check_inputs(values)
        outputs = self._runner(*values)
        n = len(outputs) - (len(self.effects.extra) if self.effects is not None else 0)
        if self.stores or self.unreplayable:
            self._store(list(outputs[n:]), leaves, (args, kwargs))
        return build(self.output_template, list(outputs[:n]), leaves)

    def _store(self, extra: list[Any], leaves: list[Any], inputs: tuple[tuple, dict]) -> None:
        """What the program stored on the call's input objects (`cache.layers[0].keys = ...`), stored again."""
        if self.unreplayable:
            raise StampoutError(message(
                f"the captured program {self.unreplayable}; a call of the capture cannot repeat that",
                user_location(), "pass input objects whose structure the call does not change (for Hugging Face, "
                "DynamicCache(config=model.config)), or capture again for each call",
            ))
        ctx = CallContext([self.fn, *leaves], self.frame_fn, inputs)
        memo: dict[Source, Any] = {}
        for source, key, kind, value in self.stores:
            if source is None:
                continue
            value = value.get(ctx, extra)
            holder = source.resolve(ctx, memo)
            if holder is MISSING:
                raise StampoutError(message(
                    f"{source.name()} was there at capture and is missing now", user_location(),
                    "pass inputs of the same structure as at capture, or capture again",
                ))
            kind.store(holder, key, value)

    def __repr__(self) -> str:
        """A few lines: what was captured, its graph's size and its region calls (not the model's tensors)."""
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        nodes = len(self.graph_module.graph.nodes)
        symbolic = ", symbolic sizes" if self.shapes is not None else ""
        return (f"Capture({name}: {len(self.input_tensor_leaves)} tensor inputs, {len(self.lifted)} lifted "
                f"(parameters, buffers, ...), {nodes} graph nodes{symbolic})\n  regions: {self.stats}")

    def explain(self) -> str:
        """A report of the capture: each region call's outcome, why a miss missed and why a trace cannot be
        reused (`Ineligible` records, counted), then `guard_code()`."""
        return explain_text(self)

    def guard_code(self) -> str:
        """The source of the generated guard predicates this capture made: one per region reuse entry (a later
        call of the region is stamped out from the entry when its predicate passes) and, for a capture made by
        `stampout.compile`, the one over everything the whole program read.

        Example::

            cap = stampout.capture(Block(), x)
            print(cap.guard_code())
            # region Block.forward -> subgraph_0 (traced at model.py:12 in forward)
            def check(leaves, fn, anchors=()):
                v0 = leaves[0]
                if not type(v0) in e0: return False
                ...

        Returns:
            The predicates' Python source, each headed by a comment naming what it guards.
        """
        return guard_code_text(self)
