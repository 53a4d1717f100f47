"""Running a program under the tracer: `capture_program` with its options (`CaptureOptions`) as its hops
(`ProgramCapture.run`): the tracer, the fake inputs, the program run, the graph's outputs, the `Capture` and what
it stores on the caller's objects. Entering the capture context (and torch's patched hooks): capture/entering.py."""

from __future__ import annotations

import functools
import inspect
import logging
import operator
from collections.abc import Callable
from itertools import repeat
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .. import torch_internals
from ..context import listeners
from ..errors import CaptureError, message, swallowed_error
from ..guards.guard import Kind
from ..regions.cache import RegionCache
from ..regions.call import RegionCalls
from ..regions.frame import ProgramIneligible, RegionFrame
from ..sources import Absolute, CallContext, Source
from ..torch_internals import (
    DisableTorchFunction,
    FakeTensor,
    FakeTensorMode,
)
from ..torch_internals import LazyGraphModule as _LazyGraphModule
from ..trace import higher_order
from ..trace.frames import swallowed, user_location
from ..trace.names import TensorNames, identifier
from ..trace.recording import refuse_shared_memory
from ..trace.shapes import ShapeGuards, Symbols, dynamic_dims, has_symbols, symbolic_fake
from ..trace.structure import aliases_of, flatten_inputs, found_within, holds_fake, positional_names, to_template
from ..trace.tracer import Tracer
from ..watch.functools_caches import CacheReads
from ..watch.tracking import Watch
from ..watch.world import FieldsBefore, RandomStates
from ..watch.world_snapshot import check_left_over
from .arguments import lazy_function
from .effects import Plan, Registries, Value, ValueKind, undo
from .entering import capturing
from .held_inputs import (
    Held,
    check_no_hidden_tensors,
    check_no_output_fields,
    copy_back_given_containers,
    held_containers,
    held_map,
    hold_input_containers,
    in_input_container,
    input_objects,
    input_stores,
    keep_held_outputs,
    note_input_containers,
    object_fields,
    rebuild_inputs,
    refuse_made_outputs,
    refuse_stored_outputs,
)
from .leftovers import (
    carried_state,
    hooks_of,
    input_held_by,
    left_over_fakes,
    make_real,
    methods_of,
    modules_of,
    uninitialized_module,
)
from .lost_gradients import autograd_refusal
from .options import CaptureOptions, refuse_lazy
from .result import Capture
from .world import (
    ModulePaths,
    concrete_stores,
    drawn_store,
    frame_function,
    held_dynamic,
    lifted_source,
    mutated_in_place,
    plant_ints,
    refuse_cached,
    refuse_subclass,
    restore_world,
    symbolic_names,
    unplant,
    warn_unnamed,
)

log = logging.getLogger("stampout.capture")


def moved_parameter(cap: Capture, ctx: CallContext) -> str | None:
    """Why the capture is refused, if the program's Python rebound a path through which the graph reads a parameter
    (`self.a, self.b = self.b, self.a`): each call of the Capture reads its parameters by path, after the capture's
    stores, so it would compute with the other module's weights (compile's calls read them before replaying)."""
    resolve = ModulePaths(ctx)
    for tensor, source in cap.lifted:
        if isinstance(tensor, torch.nn.Parameter) and source is not None and resolve(source) is not tensor:
            return message(f"stampout.capture cannot trace this program: it rebinds the path {source.name()} through "
                           "which the graph reads a parameter, so each call of the Capture would read another one",
                           user_location(), "keep the modules where they are during the call, or use stampout.compile")
    return None


def capture_program(fn: Callable, args: tuple, kwargs: dict, **options: Any) -> Capture:
    """Capture `fn(*args, **kwargs)`; `options` are the fields of CaptureOptions (`cache=`, `guard_program=True`,
    ...). The hops are ProgramCapture's, in `ProgramCapture.run`."""
    return ProgramCapture(fn, args, kwargs, CaptureOptions(**options)).run()


class ProgramCapture:
    """One capture of a program, in the hops `capture_program` takes: refuse what would lose gradients, make
    the tracer and the fake inputs, run the program under the capture (undoing everything if it fails), close
    the graph, make the `Capture`, and store on the caller's objects what one eager call would have."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, options: CaptureOptions) -> None:
        self.fn, self.args, self.kwargs, self.options = fn, args, kwargs, options
        self.cache = options.cache if options.cache is not None else RegionCache()
        self.body = options.body
        self.sharded = options.sharded
        self.guard_program = options.guard_program
        self.signature_of = fn.forward if isinstance(fn, torch.nn.Module) else fn
        names = positional_names(self.signature_of)
        if isinstance(fn, torch.nn.Module) or inspect.ismethod(fn):
            names = names[1:]  # bound: `self` is not among the call's arguments
        self.leaves, self.spec, self.labels = flatten_inputs(args, kwargs, names)
        self.program: RegionFrame | None = None
        self.plan: Plan | None = None
        self.stores: list = []
        self.unreplayable = ""
        self.left: list = []
        self.refusal: str | None = None  # (a capture refused once the objects are as eager leaves them)
        self.clean: dict[int, Any] = {}  # (what the left-over pass found reaching no traced value: see store_on_inputs)
        self._modules: list[Any] | None = None  # (the module tree, listed once before the run and once after it)

    def run(self) -> Capture:
        """The hops, in order; the `Capture`."""
        options = self.options
        lazy = lazy_function(self.fn if self.body is None else self.body)
        if lazy is not None:  # (compile runs such a function eagerly)
            raise CaptureError(message(f"stampout cannot capture it: {lazy}", user_location(),
                                       "capture the function that computes one item, or use stampout.compile"))
        self.refuse_lost_gradients()
        lazy_module = uninitialized_module(self.fn, self.modules())
        if lazy_module is not None:  # (compile runs such a call eagerly, then captures the initialized model)
            raise CaptureError(message(f"stampout cannot capture it: its {lazy_module} is not initialized yet (a lazy "
                                       "module makes its parameters on its first call)", user_location(),
                                       "call the model once eagerly before capturing it, or use stampout.compile"))
        held_input = None if self.guard_program else input_held_by(self.modules(), self.leaves, self.labels)
        if held_input is not None:  # (compile: the program frame finds such a read, and runs that call eagerly)
            raise CaptureError(message(f"stampout cannot capture it: {held_input} (the trace would see two tensors "
                                       "where eager has one)", user_location(), "pass another tensor, or use "
                                       "stampout.compile, which runs such a call eagerly"))
        self.make_tracer(options.dynamic, options.automatic or {}, options.dynamic_sources or {},
                         options.dynamic_ints or set())
        self.make_fake_inputs(options.ranges, options.dynamic_ints or set())
        self.run_program()
        self.finish_outputs()
        cap = self.make_capture()
        if self.program is None:
            self.store_on_inputs(cap, options.real)
        if options.real:  # (export puts its objects back itself, after this)
            with DisableTorchFunction():
                check_left_over(self.handler.snapshot, self.objects())
        if self.refusal is not None:  # (refused with the objects as one eager call leaves them)
            raise CaptureError(self.refusal)
        return cap

    def modules(self) -> list[Any]:
        """The program's module tree (`modules_of`), listed once while no Python of the program runs: before the
        run, and again after it (the run may register or move modules; `_traced` drops the list it had)."""
        if self._modules is None:
            self._modules = modules_of(self.fn)
        return self._modules

    def objects(self, modules: list[Any] | None = None) -> list[Any]:
        """The objects the program's Python may have changed: its modules (`modules`, where listed already) and the
        objects its inputs hold."""
        return [*(self.modules() if modules is None else modules), *held_map(self.leaves, self.labels)]

    def refuse_lost_gradients(self) -> None:
        refusal = autograd_refusal(self.fn, own_hooks_outside=self.body is not None and not self.sharded,
                                   sharded_boundaries=self.sharded, modules=self.modules())
        if refusal is not None:
            raise CaptureError(message(
                f"stampout.capture cannot keep the gradients of this program: {refusal}", user_location(),
                "capture under torch.no_grad(), remove the hook, or use stampout.compile (which runs such hooks "
                "eagerly: FSDP's around each sharded module's compiled forward)",
            ))

    def make_tracer(self, dynamic: bool | None, automatic: dict[int, set[int]],
                    dynamic_sources: dict[Source, set[int]], dynamic_ints: set[Source]) -> None:
        """The fake mode (with a ShapeEnv where any size is symbolic), the tracer and its region handler."""
        self.dims = [dynamic_dims(leaf, dynamic, automatic.get(i, set())) if isinstance(leaf, torch.Tensor) else ()
                     for i, leaf in enumerate(self.leaves)]
        dynamic_held = held_dynamic(self.fn, self.leaves, dynamic_sources)
        self.symbolic = any(self.dims) or bool(dynamic_held) or bool(dynamic_ints)
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=False,
                                        shape_env=ShapeEnv() if self.symbolic else None)
        self.watch = watch = Watch()
        cache = self.cache
        self.tracer = tracer = Tracer(self.fake_mode, TensorNames(self.fn, self.leaves, self.labels),
                                      higher_order.call_if_handled,
                                      regions=lambda tracer: RegionCalls(tracer, cache, watch))
        handler = tracer.regions
        assert isinstance(handler, RegionCalls)
        self.handler = handler
        tracer.dynamic_tensors = dynamic_held
        if self.symbolic:
            tracer.symbols = Symbols(self.fake_mode.shape_env, self.fake_mode)

    def make_fake_inputs(self, ranges: dict[int, dict[int, tuple]] | None, dynamic_ints: set[Source]) -> None:
        """A fake for each input tensor (symbolic in the dims asked for), a placeholder for each, the inputs
        rebuilt around them, and the int attributes to capture as symbols planted."""
        fake_mode, tracer, leaves, labels = self.fake_mode, self.tracer, self.leaves, self.labels
        names = [identifier(label) for label in labels]
        fake_leaves = list(leaves)
        self.tensor_leaves: list[int] = []
        self.input_fields: dict[int, tuple[tuple, dict]] = {}
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                continue
            refuse_shared_memory(tracer.memory, leaf, labels[i])
            if self.dims[i]:
                fake = symbolic_fake(fake_mode, leaf, names[i], self.dims[i], duck=ranges is None)
                for dim, (low, high, _) in (ranges or {}).get(id(leaf), {}).items():  # bounds asked for (export)
                    size = fake.shape[dim]
                    if isinstance(size, torch.SymInt) and not size.node.expr.is_number:
                        fake_mode.shape_env.constrain_symbol_range(size.node.expr, max(low, 2), high)
            else:
                fake = fake_mode.from_tensor(leaf, static_shapes=True)
            if not isinstance(fake, type(leaf)):  # a subclass made by `as_subclass`: the program would not see it
                refuse_subclass(leaf, labels[i], self.guard_program)
            if id(fake) not in tracer.root.nodes:
                node = tracer.root.placeholder(names[i], fake)
                self.tensor_leaves.append(i)
                if has_symbols(fake):
                    tracer.symbols.bind_input(i, fake, node)
            fields = {k: v for k, v in leaf.__dict__.items() if not k.startswith("_")} if leaf.__dict__ else None
            if fields:  # Python attributes the caller set on the tensor (`x.scale`): the program may read them
                fake.__dict__.update(fields)
                self.input_fields[i] = (tuple(leaf.__dict__), fields)
            fake_leaves[i] = fake
        self.fake_leaves = fake_leaves
        self.fake_args, self.fake_kwargs = rebuild_inputs(self.args, self.kwargs, fake_leaves)
        self.planted = plant_ints(self.fn, leaves, dynamic_ints, tracer) if self.symbolic else []

    def run_program(self) -> None:
        """Run the program on the fakes under the capture; on failure put back everything it changed and
        raise; on success undo or keep (as real values) what it stored, and restore the world."""
        fn, handler, guard_program = self.fn, self.handler, self.guard_program
        held = held_map(self.leaves, self.labels) if not guard_program else Held()
        if not guard_program:  # the lists and dicts the call was given (rebuilt for the capture): what it stores in
            hold_input_containers(held, self.signature_of, fn, self.fake_args, self.fake_kwargs)
        self.held = held
        self.before = {id(obj): object_fields(obj) for obj in held}
        modules = self.modules()  # (one list for both: nothing in between changes the tree)
        self.fields_before = FieldsBefore.take(self.objects(modules))  # (what the world repair puts back)
        states = RandomStates.save()
        self.tracer.rng_state = states.torch_cpu
        registries = Registries(modules)
        handler.snapshot.note_program([frame_function(fn), *methods_of(modules), *hooks_of(modules)])
        handler.snapshot.note_settings()
        for klass in dict.fromkeys(type(m) for m in modules):  # memo caches kept on the classes (an lru_cache method)
            handler.snapshot.note(klass, 1)
        for m in modules:  # and on the modules (`self.table = functools.cache(fn)`; the class is not subclassable:
            fields = vars(m).values()  # its exact class, compared in C, found first)
            if any(map(operator.is_, map(type, fields), repeat(functools._lru_cache_wrapper))):
                for value in list(fields):
                    if type(value) is functools._lru_cache_wrapper:
                        handler.snapshot.note(value, 1)
        try:
            try:
                self._modules = None  # (the program's Python runs: the tree is listed again after it)
                self._traced(registries)
            finally:  # (closures first reached during the call: their cells are user state too)
                self._modules = None
                if self.program is not None:
                    handler.snapshot.note_cells_read(self.program.cells_read)
            rebound = handler.snapshot.rebound_cells() if not guard_program else None
            if rebound:  # (compile: found by restore_world below, and the program runs eagerly)
                raise CaptureError(message(
                    f"the program rebinds {rebound[0]} to a traced value: each call of the Capture would "
                    "leave it as the capture left it", user_location(), "keep the value on an object (an "
                    "attribute or a list item), or use stampout.compile, which runs such a function eagerly"))
        except BaseException:
            if self.program is not None:  # a failed capture leaves the objects as it found them
                undo(self.program)
            registries.put_back()
            handler.snapshot.put_back_classes()
            unplant(self.planted)
            objects = self.objects()
            restore_world(handler, states, objects, self.fields_before)
            with DisableTorchFunction():
                check_left_over(handler.snapshot, objects)
            raise
        program = self.program
        if program is not None and guard_program:
            undo(program)
            self.plan.check_named(CallContext([self.fn, *self.fake_leaves], frame_function(self.fn),
                                              (self.fake_args, self.fake_kwargs)))
        elif program is not None:
            concrete_stores(program, held)
        unplant(self.planted)
        if guard_program:  # what no replayed effect would store again: compiled calls cannot repeat it
            settings = handler.snapshot.settings_changed()
            if settings:  # (set again by the eager call: no graph does)
                program.mark_ineligible(f"sets {settings[0]} (a process-wide torch setting a graph does not set)")
            classes = handler.snapshot.classes_changed()
            if classes:
                handler.snapshot.put_back_classes()
                program.mark_ineligible(f"writes the class attribute {classes[0]} (a Python side effect stampout "
                                        "does not replay)")
            left_behind = restore_world(handler, states, self.objects(), self.fields_before)
            if left_behind:
                program.mark_ineligible(f"stores traced values outside the objects stampout replays: "
                                        f"{left_behind}")
        else:
            states.restore()  # (the rest of the world after the graph computed what it can: finish_outputs)
            self.plan, self.program = None, None
            traced = handler.snapshot.traced_class_attributes()
            if traced:  # (`type(self).cache = t`: no store of the Capture's gives the class its real value)
                self.refusal = message(f"stampout.capture cannot trace this program: it stores a traced value in the "
                                       f"class attribute {traced[0]} (put back as it was), which no call of the "
                                       "Capture would store", user_location(), "keep the value on the instance, or "
                                       "use stampout.compile, which runs such a call eagerly")

    def _traced(self, registries: Registries) -> None:
        """The program's call under the capture context (with a frame guarding it, for compile), its outputs
        as a template, and the registrations and stores it made."""
        fn, handler, guard_program, fake_args, fake_kwargs = (self.fn, self.handler, self.guard_program,
                                                              self.fake_args, self.fake_kwargs)
        with capturing(self.tracer, handler, self.watch) as ctx:
            if guard_program or self.symbolic:  # (a symbolic capture: to find every size the Python stored)
                inputs = {id(t): label for t, label in zip(self.leaves, self.labels) if isinstance(t, torch.Tensor)}
                program = self.program = RegionFrame(frame_function(fn), [fn, *self.fake_leaves],
                                                     ["self", *self.labels], self.watch, program=True,
                                                     input_tensors=inputs)
                if guard_program and program.ineligible:
                    raise ProgramIneligible(program.ineligible[0].reason, program.ineligible[0].only_while)
                program.abandon = guard_program
                handler.program = program
                handler.push(program)
                if guard_program:
                    note_input_containers(program, self.signature_of, fn, fake_args, fake_kwargs)
                for i, (keys, fields) in self.input_fields.items():
                    program.note_tensor_fields(i + 1, keys, fields, "attributes of the input tensors")
                ctx.read, ctx.write = handler.on_read, handler.on_write
            try:
                out = (fn if self.body is None else self.body)(*fake_args, **fake_kwargs)
            except Exception as error:  # (the program's own error, after it caught one of ours: that one)
                caught = swallowed(ctx, 0, error)
                if caught is None:
                    raise
                raise swallowed_error(caught) from error
            caught = swallowed(ctx)
            if caught is not None:  # it caught an error stampout raised and went on: what it traced is not eager's
                raise swallowed_error(caught)
            handler.snapshot.clear_caches(nodes=self.tracer.root.nodes)
            cached, filled = handler.snapshot.traced_caches, handler.snapshot.filled_caches
            if cached or guard_program and filled:  # (capture: a result drawn at random; compile: any traced one)
                name = cached[0] if cached else getattr(filled[0], "__qualname__", "?")
                refuse_cached(name, self.program if guard_program else None, filled)
            read = handler.snapshot.caches_read() if guard_program else None
            if read:  # (a hit's result is in the graph: a cleared cache captures again)
                self.program.guard(Absolute(CacheReads(read), "functools caches read"), Kind.NAMESPACE, None,
                                   "functools caches")
            if inspect.isgenerator(out) or inspect.iscoroutine(out) or inspect.isasyncgen(out):
                refuse_lazy(out, guard_program)
            program = self.program
            if program is not None:
                program.abandon = False
            self.holes: list[torch.Tensor] = []
            held = held_containers(program) if program is not None else ()
            self.template = to_template(out, self.holes, input_objects(self.leaves), sizes=True, world=held)
            check_no_hidden_tensors(self.template, held)
            if program is not None:
                keep_held_outputs(self.template, program, held)
                refuse_stored_outputs(out, program, held)
                refuse_made_outputs(self.template, program)
            check_no_output_fields(self.holes, self.tracer)
            with DisableTorchFunction(), listeners(None, None):
                if guard_program:
                    registries.plan(program)
                elif registries.made_modules():
                    raise CaptureError(message(
                        f"the program registers {registries.made_modules()[0]}, a module it makes during the call: "
                        "its parameters are initialized on traced values, not as eager initializes them",
                        user_location(), "make the module in __init__, or use stampout.compile (which captures "
                        "again once it exists)"))
                if program is not None:
                    program.close()
                    self.plan = Plan(program)
                self.holders = [*self.watch.objects(), *self.handler.stored.values()]  # (what stamped calls stored on)

    def finish_outputs(self) -> None:
        """The graph's outputs: the program's, then (a capture's) the values it stored that must end up real."""
        tracer, held = self.tracer, self.held
        if self.plan is None:  # what the Python stored on the model and objects it read must end up real, as in eager
            plan = self.plan = Plan(None)
            self.stores, self.unreplayable = input_stores(held, self.before, tracer, plan)
            made = [h for h in held_map(self.leaves, self.labels) if h not in held]  # objects the call added
            if made and not self.unreplayable:
                self.unreplayable = f"adds a {type(made[0]).__name__} it made to its input objects"
            holders = [h for h in [*made, *self.holders, *self.modules()] if h not in held]
            if self.unreplayable:  # (later calls refuse, but the caller's objects end as one eager call leaves them:
                # the objects it holds, and the containers it was given, which the program changed as copies)
                holders += [h for h in held if not isinstance(h, (list, dict, set))
                            or type(h) in (list, dict) and in_input_container(held[h])]
            holders += [h for h in held if type(h) is set]  # (a set: no store is repeated, its fakes made real)
            self.left = left_over_fakes(holders, tracer, plan, self.clean)
            self.left += self.handler.snapshot.graph_values(tracer.root.nodes, plan.extra)  # memo dicts, globals
            self.refusal = self.refusal or drawn_store(tracer, self.left, plan.extra[len(plan.extra) - len(self.left):],
                                                       self.made_modules)
        nodes = [tracer.root.node_for(t) for t in [*self.holes, *self.plan.extra]]
        if not self.guard_program:
            warn_unnamed(tracer, self.program)
        tracer.root.sync_inference()
        tracer.root.graph.output(tuple(nodes))

    def made_modules(self) -> list[torch.nn.Module]:
        """The modules the program read that are not its own: ones it made during the call."""
        kept = {id(m) for m in self.modules()}  # (the whole tree: each module's own subtree is in it)
        return [m for m in self.holders if isinstance(m, torch.nn.Module) and id(m) not in kept]

    def make_capture(self) -> Capture:
        fn, tracer, handler, cache, program = self.fn, self.tracer, self.handler, self.cache, self.program
        graph = tracer.root.graph
        graph_module = torch_internals.without_module_hooks(
            _LazyGraphModule(tracer.root.submodules, graph, class_name="Captured"))
        stats = handler.stats
        stats.subgraphs = len({e.subgraph for e in handler.events})
        log.info("captured %s: %d nodes, regions: %s", getattr(fn, "__qualname__", type(fn).__name__),
                 len(graph.nodes), stats)
        return Capture(
            graph_module=graph_module,
            input_spec=self.spec,
            input_tensor_leaves=self.tensor_leaves,
            input_aliases=aliases_of(self.leaves),
            lifted=[(t, lifted_source(t, found, program)) for _, t, found in tracer.lifted],
            fill_meta=tracer.fill_meta,
            output_template=self.template,
            stats=stats,
            events=handler.events,
            fn=fn,
            frame_fn=frame_function(fn),
            program=program,
            effects=self.plan,
            shapes=ShapeGuards(tracer.symbols, symbolic_names(tracer, self.labels)) if self.symbolic else None,
            reuse_entries=[e for entries in cache.entries.values() for e in entries
                           if e.generation == cache.generation],
        )

    def store_on_inputs(self, cap: Capture, real: bool) -> None:
        """(A capture, not compile's.) What the program stored on its input objects, for each call to store; with
        `real`, the caller's objects left as one eager call leaves them."""
        stores, left, args, kwargs = self.stores, self.left, self.args, self.kwargs
        outs = sum(v.kind is ValueKind.OUT for *_, v in stores)
        ctx = CallContext([self.fn, *self.leaves], None, (args, kwargs))
        carried = carried_state(cap, left, ctx)
        cap.stores = stores + [(Absolute(obj, f"{type(obj).__name__}.{key}") if k in carried else None, key, kind,
                                Value(ValueKind.OUT, outs + k)) for k, (obj, key, kind) in enumerate(left)]
        cap.unreplayable = self.unreplayable
        if real:  # the caller's containers were not the program's (it ran on copies): stored into as eager does
            for s, key, _, v in stores:  # (in the program's order: a dict keeps eager's key order)
                if in_input_container(s):
                    holder = s.resolve(ctx, {})
                    if v.kind is not ValueKind.OUT:
                        holder[key] = v.get(ctx, [])
                    elif isinstance(holder, dict):
                        holder.setdefault(key, None)  # its real value comes from the graph, below
        written = any(isinstance(f, FakeTensor) and (f.is_inference() or f._version > 0)  # (`x.add_(1)`; an
                      for f in self.fake_leaves)  # inference tensor keeps no version: may have been written)
        if real and (self.plan.extra or self.held or written):  # the caller's objects and tensors end up as one
            # eager call leaves them (a tensor argument written in place as one an input object holds)
            make_real(cap, [(s.resolve(ctx, {}), key, kind)
                             for s, key, kind, v in stores if v.kind is ValueKind.OUT] + left, args, kwargs,
                       mutated_in_place(self.tracer, self.leaves, cap),
                       {outs + k: t for k, t in carried.items()})
            self._modules = None  # (the graph's run may have called the program's Python: an autograd Function's)
        if real and self.unreplayable:  # the containers it was given: as the program left its copies of them
            lost = copy_back_given_containers(self.held, ctx)
            if lost and self.refusal is None:
                self.refusal = message(f"stampout.capture cannot trace this program: it stores a traced tensor "
                                       f"inside an object it puts in {lost[0]}, which the graph does not compute",
                                       user_location(), "store the tensors themselves, or use stampout.compile")
        # A tensor the graph computes, still fake where no store can put its real value (a dict key, a tuple): refused.
        nodes = self.tracer.root.nodes
        objects = self.objects()  # (the same list below: moved_parameter, in between, only reads)
        places = [*objects, *self.handler.snapshot.contents()]
        # (not real: export puts the objects back itself.) First whether anything traced is left at all: where not
        # (the common case), what that walk went through is clean for the world repair below, which then walks
        # none of it again (Note: clean objects; nothing in between stores a traced value)
        # The left-over pass's clean objects too, where it found nothing left (so no fake was made real) and no
        # container the program was given was copied back: what ran since stored real values only.
        clean = self.clean if not self.unreplayable else {}
        stuck = real and holds_fake(places, whole=True, clean=clean) and found_within(
            places, lambda v: type(v) is FakeTensor and id(v) in nodes, first=True, whole=True)
        moved = (moved_parameter(cap, CallContext([self.fn, *self.leaves], frame_function(self.fn)))
                 if real and self.refusal is None and not stuck else None)
        # What the graph could not compute (a region's cached_property, a cache filled inside a region): put back
        # as it was before the program ran.
        left_behind = restore_world(self.handler, None, objects, self.fields_before, clean)
        if stuck and self.refusal is None:
            self.refusal = message("stampout.capture cannot trace this program: it stores a traced tensor where no "
                                   "store can give it its real value (a dict key, a tuple, a partial's arguments, "
                                   f"a deque){f': {left_behind} (put back as it was)' if left_behind else ''}",
                                   user_location(), "store the tensor itself on an object, a list or a dict value, "
                                   "or use stampout.compile")
        elif moved is not None and self.refusal is None:
            self.refusal = moved
