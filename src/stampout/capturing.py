"""Running a program under the tracer: the capture context, the patched torch hooks, inputs made fake,
and the finished `Capture`."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from . import higher_order, torch_internals
from .builder import identifier
from .capture import Capture
from .context import CAPTURE_LOCK, CaptureContext, current, entered, listeners
from .effects import Plan, Registries, Value, undo
from .errors import CaptureError, message
from .frames import user_location
from .held_inputs import (
    Held,
    check_no_hidden_tensors,
    held_map,
    hold_input_containers,
    in_input_container,
    input_objects,
    input_stores,
    note_input_containers,
    object_fields,
    rebuild_inputs,
)
from .leftovers import left_over_fakes, make_real, methods_of, modules_of
from .names import TensorNames, root_module
from .op_errors import quiet_fake_kernels
from .regions.cache import RegionCache
from .regions.call import RegionCalls
from .regions.frame import ProgramIneligible, RegionFrame
from .regions.marker import innermost, torch_marked_call
from .shapes import ShapeGuards, Symbols, any_symbolic, concrete, dynamic_dims, has_symbols, symbolic_fake
from .sources import Arg, Attr, CallContext, Input, Source
from .structure import aliases_of, flatten_inputs, positional_names, to_template
from .tracer import CaptureMode, Tracer
from .tracking import Watch
from .world import RandomStates, autograd_refusal, check_left_over, clear_fakes

log = logging.getLogger("stampout.capture")


def _our_mode_for_vmap(original: Callable) -> Callable:
    """vmap routes its batching calls through a pre-dispatch mode only under export; do it under capture too
    (on the capturing thread only)."""

    def find() -> Any:
        if current() is not None and torch._C._is_torch_function_mode_enabled():
            for mode in torch.overrides._get_current_function_mode_stack():
                if isinstance(mode, CaptureMode):
                    return mode
        return original()

    return find


def _autograd_function_apply(original: Callable) -> Callable:
    """`Function.apply` during a capture: on the capturing thread the call is recorded as one node (its
    custom backward kept), elsewhere it is the original."""

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        ctx = current()
        if ctx is None or not torch._C._is_torch_function_mode_enabled():
            return original(cls, *args, **kwargs)
        return ctx.tracer.on_autograd_function(cls, original, args, kwargs)

    return apply


def _capturing_here() -> bool:
    """Whether this thread is running a capture's program (what `torch.compiler.is_compiling()` answers)."""
    return current() is not None and torch._C._is_torch_function_mode_enabled()


@contextlib.contextmanager
def _capturing(tracer: Tracer, handler: RegionCalls, watch: Watch) -> Iterator[CaptureContext]:
    """Enter the capture context, the fake and torch-function modes, and patch what capture needs; restore
    all on exit. One capture at a time per process (the patched torch hooks are process-wide)."""
    if current() is not None:
        raise CaptureError(message(
            "stampout.capture (or a stampout.compile'd function) was called while another capture runs",
            user_location(), "call the compiled function or capture from outside the captured code",
        ))
    grad = torch.is_grad_enabled()
    with CAPTURE_LOCK:
        ctx = CaptureContext(handler, tracer)
        try:
            hooks = torch_internals.capture_hooks(torch_marked_call, _our_mode_for_vmap, _autograd_function_apply,
                                                  _capturing_here)
            with hooks, quiet_fake_kernels(lambda: current() is not None), entered(ctx), tracer.fake_mode, tracer.mode:
                handler.start()
                try:
                    yield ctx
                finally:
                    handler.stop()
        finally:
            while handler.frames:
                handler.pop()
            watch.restore()
            torch._C._set_grad_enabled(grad)


def frame_function(fn: Callable) -> Callable:
    """The Python function whose closures and globals a call of `fn` reads."""
    root = root_module(fn)
    if root is not None and fn is root:
        return innermost(type(root).forward)
    return getattr(fn, "__func__", fn)


def capture_program(fn: Callable, args: tuple, kwargs: dict, cache: RegionCache | None = None,
                    guard_program: bool = False, dynamic: bool | None = None,
                    automatic: dict[int, set[int]] | None = None,
                    dynamic_sources: dict[Source, set[int]] | None = None,
                    ranges: dict[int, dict[int, tuple]] | None = None,
                    dynamic_ints: set[Source] | None = None, real: bool = True,
                    body: Callable | None = None) -> Capture:
    """Capture `fn(*args, **kwargs)`, with a region cache to share between captures, and (for `compile`)
    guards on everything the whole program read, recorded in `Capture.program`.

    Input dims are symbolic where marked with `torch._dynamo.mark_dynamic`, all of them with `dynamic=True`,
    and, per flat input leaf, the dims in `automatic` (see shapes.dynamic_dims); `dynamic_sources` does the same
    for tensors the program reads through its input objects (a KV cache's `layers[0].keys`). `ranges` bounds
    symbolic dims: {id(input tensor): {dim: (min, max, _)}}. The int attributes at `dynamic_ints` are read as
    symbols during the capture (inputs of the graph, read per call). With `real=False` (export) the graph is
    not run to store real values on the caller's objects: the caller puts its objects back itself. `body`
    (a module's forward, see sharded.py) is what runs in place of `fn`: the module's hooks run outside."""
    refusal = autograd_refusal(fn, own_hooks_outside=body is not None)
    if refusal is not None:
        raise CaptureError(message(
            f"stampout.capture cannot keep the gradients of this program: {refusal}", user_location(),
            "capture under torch.no_grad(), remove the hook, or use stampout.compile (which runs such hooks "
            "eagerly: FSDP's around each sharded module's compiled forward)",
        ))
    signature_of = fn.forward if isinstance(fn, torch.nn.Module) else fn
    names = positional_names(signature_of)
    if isinstance(fn, torch.nn.Module) or inspect.ismethod(fn):
        names = names[1:]  # bound: `self` is not among the call's arguments
    leaves, spec, labels = flatten_inputs(args, kwargs, names)
    automatic = automatic or {}
    dims = [dynamic_dims(leaf, dynamic, automatic.get(i, set())) if isinstance(leaf, torch.Tensor) else ()
            for i, leaf in enumerate(leaves)]
    dynamic_held = _held_dynamic(fn, leaves, dynamic_sources or {})
    symbolic = any(dims) or bool(dynamic_held) or bool(dynamic_ints)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False, shape_env=ShapeEnv() if symbolic else None)
    watch = Watch()
    cache = cache if cache is not None else RegionCache()
    tracer = Tracer(fake_mode, TensorNames(fn, leaves, labels), higher_order.call_if_handled,
                    regions=lambda tracer: RegionCalls(tracer, cache, watch))
    handler = tracer.regions
    assert isinstance(handler, RegionCalls)
    tracer.dynamic_tensors = dynamic_held
    if symbolic:
        tracer.symbols = Symbols(fake_mode.shape_env, fake_mode)
    names = [identifier(label) for label in labels]
    fake_leaves = list(leaves)
    tensor_leaves = []
    input_fields: dict[int, tuple[tuple, dict]] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if dims[i]:
                fake = symbolic_fake(fake_mode, leaf, names[i], dims[i], duck=ranges is None)
                for dim, (low, high, _) in (ranges or {}).get(id(leaf), {}).items():  # bounds asked for (export)
                    size = fake.shape[dim]
                    if isinstance(size, torch.SymInt) and not size.node.expr.is_number:
                        fake_mode.shape_env.constrain_symbol_range(size.node.expr, max(low, 2), high)
            else:
                fake = fake_mode.from_tensor(leaf, static_shapes=True)
            if not isinstance(fake, type(leaf)):  # a subclass made by `as_subclass`: the program would not see it
                _refuse_subclass(leaf, labels[i], guard_program)
            if id(fake) not in tracer.root.nodes:
                node = tracer.root.placeholder(names[i], fake)
                tensor_leaves.append(i)
                if has_symbols(fake):
                    tracer.symbols.bind_input(i, fake, node)
            fields = {k: v for k, v in leaf.__dict__.items() if not k.startswith("_")} if leaf.__dict__ else None
            if fields:  # Python attributes the caller set on the tensor (`x.scale`): the program may read them
                fake.__dict__.update(fields)
                input_fields[i] = (tuple(leaf.__dict__), fields)
            fake_leaves[i] = fake
    fake_args, fake_kwargs = rebuild_inputs(args, kwargs, fake_leaves)
    planted = _plant_ints(fn, leaves, dynamic_ints or set(), tracer) if symbolic else []

    program = None
    plan = None
    held = held_map(leaves, labels) if not guard_program else Held()
    if not guard_program:  # the lists and dicts the call was given (rebuilt for the capture): what it stores in them
        hold_input_containers(held, signature_of, fn, fake_args, fake_kwargs)
    before = {id(obj): object_fields(obj) for obj in held}
    states = RandomStates.save()
    tracer.rng_state = states.torch_cpu
    modules = modules_of(fn)
    registries = Registries(modules)
    handler.snapshot.note_program([frame_function(fn), *methods_of(modules)])
    for klass in dict.fromkeys(type(m) for m in modules):  # memo caches kept on the classes (an lru_cache method)
        handler.snapshot.note(klass, 1)
    try:
        with _capturing(tracer, handler, watch) as ctx:
            if guard_program or symbolic:  # (a symbolic capture: to find every size the Python stored)
                program = RegionFrame(frame_function(fn), [fn, *fake_leaves], ["self", *labels], watch,
                                      program=True)
                if guard_program and program.ineligible:
                    raise ProgramIneligible(program.ineligible[0])
                program.abandon = guard_program
                handler.program = program
                handler.push(program)
                if guard_program:
                    note_input_containers(program, signature_of, fn, fake_args, fake_kwargs)
                for i, (keys, fields) in input_fields.items():
                    program.note_tensor_fields(i + 1, keys, fields, "attributes of the input tensors")
                ctx.read, ctx.write = handler.on_read, handler.on_write
            out = (fn if body is None else body)(*fake_args, **fake_kwargs)
            if program is not None:
                program.abandon = False
            slots: list[torch.Tensor] = []
            template = to_template(out, slots, input_objects(leaves), sizes=True)
            check_no_hidden_tensors(template)
            with torch._C.DisableTorchFunction(), listeners(None, None):
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
                    plan = Plan(program)
                holders = watch.objects()
    except BaseException:
        if program is not None:  # a failed capture leaves the objects as it found them
            undo(program)
        registries.put_back()
        handler.snapshot.put_back_classes()
        _unplant(planted)
        objects = [*modules_of(fn), *held_map(leaves, labels)]
        _restore_world(handler, states, objects)
        with torch._C.DisableTorchFunction():
            check_left_over(handler.snapshot, objects)
        raise
    else:
        if program is not None and guard_program:
            undo(program)
        elif program is not None:
            _concrete_stores(program, held)
        _unplant(planted)
        if guard_program:  # what no replayed effect would store again: compiled calls cannot repeat it
            classes = handler.snapshot.classes_changed()
            if classes:
                handler.snapshot.put_back_classes()
                program.mark_ineligible(f"writes the class attribute {classes[0]} (a Python side effect stampout "
                                        "does not replay)")
            left_behind = _restore_world(handler, states, [*modules_of(fn), *held_map(leaves, labels)])
            if left_behind:
                program.mark_ineligible(f"stores traced values outside the objects stampout replays: "
                                        f"{left_behind}")
        else:
            states.restore()  # (the rest of the world after the graph computed what it can: below)
    if not guard_program:
        plan, program = None, None
    if plan is None:  # what the Python stored on the model and objects it read must end up real, as in eager
        plan = Plan(None)
        stores, unreplayable = input_stores(held, before, tracer, plan)
        made = [h for h in held_map(leaves, labels) if h not in held]  # objects the call added to inputs
        if made and not unreplayable:
            unreplayable = f"adds a {type(made[0]).__name__} it made to its input objects"
        left = left_over_fakes([h for h in [*made, *holders, *modules_of(fn)] if h not in held], tracer, plan)
        left += handler.snapshot.graph_values(tracer.root.nodes, plan.extra)  # memo dicts, globals: real too
    nodes = [tracer.root.node_for(t) for t in [*slots, *plan.extra]]
    if not guard_program:
        _warn_unnamed(tracer, program)
    graph = tracer.root.graph
    tracer.root.sync_inference()
    graph.output(tuple(nodes))
    graph_module = torch_internals.without_module_hooks(
        _LazyGraphModule(tracer.root.submodules, graph, class_name="Captured"))
    stats = handler.stats
    stats.subgraphs = len({e.subgraph for e in handler.events})
    log.info("captured %s: %d nodes, regions: %s", getattr(fn, "__qualname__", type(fn).__name__),
             len(graph.nodes), stats)
    cap = Capture(
        graph_module=graph_module,
        input_spec=spec,
        input_tensor_leaves=tensor_leaves,
        input_aliases=aliases_of(leaves),
        lifted=[(t, _lifted_source(t, found, program)) for _, t, found in tracer.lifted],
        fill_meta=tracer.fill_meta,
        output_template=template,
        stats=stats,
        events=handler.events,
        fn=fn,
        frame_fn=frame_function(fn),
        program=program,
        effects=plan,
        shapes=ShapeGuards(tracer.symbols, _symbolic_names(tracer, labels)) if symbolic else None,
    )
    if program is None:
        outs = sum(v.kind == "out" for *_, v in stores)
        cap.stores = stores + [(None, key, kind, Value("out", outs + k)) for k, (_, key, kind) in enumerate(left)]
        cap.unreplayable = unreplayable
        ctx = CallContext([fn, *leaves], None, (args, kwargs))
        if real:  # the caller's containers were not the program's (it ran on copies): stored into as eager does
            for s, key, _, v in stores:  # (in the program's order: a dict keeps eager's key order)
                if in_input_container(s):
                    holder = s.resolve(ctx, {})
                    if v.kind != "out":
                        holder[key] = v.get(ctx, [])
                    elif isinstance(holder, dict):
                        holder.setdefault(key, None)  # its real value comes from the graph, below
        if real and (plan.extra or held):  # the caller's objects end up as one eager call leaves them
            make_real(cap, [(s.resolve(ctx, {}), key, kind)
                             for s, key, kind, v in stores if v.kind == "out"] + left, args, kwargs,
                       _mutated_in_place(tracer, leaves, cap))
        # What the graph could not compute (a region's cached_property, a cache filled inside a region): removed.
        _restore_world(handler, None, [*modules_of(fn), *held_map(leaves, labels)])
    if real:  # (export puts its objects back itself, after this)
        with torch._C.DisableTorchFunction():
            check_left_over(handler.snapshot, [*modules_of(fn), *held_map(leaves, labels)])
    return cap


def _refuse_subclass(leaf: torch.Tensor, label: str, guard_program: bool) -> None:
    why = (f"takes a {type(leaf).__qualname__} as {label}, a torch.Tensor subclass stampout would trace as a plain "
           "tensor (isinstance checks and its methods would see the wrong class)")
    if guard_program:
        raise ProgramIneligible(why)
    raise CaptureError(message(f"stampout.capture cannot trace this program: {why}", user_location(),
                               "pass a plain tensor (x.as_subclass(torch.Tensor)), or use stampout.compile, which "
                               "runs such calls eagerly"))


def _mutated_in_place(tracer: Tracer, leaves: list[Any], cap: Capture) -> list[torch.Tensor]:
    """The real tensors of the program's own state (buffers, parameters, globals) it changed in place, by their
    fakes' versions. Not the inputs' tensors (a KV cache's): the objects the caller passed are left as one eager
    call leaves them, Python state and tensors together."""
    inputs = {id(t) for t in leaves if isinstance(t, torch.Tensor)}
    inputs.update(id(t) for t, source in cap.lifted if source is not None and _from_the_inputs(source))
    return list({id(t): t for t, f in tracer._fakes.values()
                 if f._version > 0 and not isinstance(t, FakeTensor) and id(t) not in inputs}.values())


def _from_the_inputs(source: Source) -> bool:
    """Whether `source` starts at an input of the call (leaf 0 of a call context is the program itself)."""
    while source.base() is not None:
        source = source.base()
    return isinstance(source, Input) or (isinstance(source, Arg) and source.index != 0)


def _restore_world(handler: RegionCalls, states: RandomStates | None, objects: list[Any]) -> str:
    """Put back the random generators, and take every fake tensor and symbolic size out of what the program's
    code could reach (globals, memo caches, class dicts; the attributes of `objects`). Returns what held
    traced values other than in caches (empty: nothing). See world.py."""
    if states is not None:
        states.restore()
    with torch._C.DisableTorchFunction():
        repairs = handler.snapshot.repair()
        repairs.places.extend(clear_fakes(objects))
    if repairs.caches or repairs.places:
        log.info("after the capture: put right %s", repairs.describe())
    return ", ".join(repairs.places)


def _concrete_stores(program: RegionFrame, held: Held) -> None:
    """What the captured Python stored (attributes, list and dict items, globals) holds no symbolic size
    afterwards: each has its value for the capture's own inputs, as one eager call leaves it. (Stores on the
    input objects are the Capture's to repeat per call, computed by the graph: see `input_stores`.)"""
    with torch._C.DisableTorchFunction(), listeners(None, None):
        for obj, name, _, _, _ in program.stores:
            value = getattr(obj, name, None)
            if any_symbolic(value) and obj not in held:
                object.__setattr__(obj, name, concrete(value))
        for container, *_ in program.containers:
            if container in held:
                continue
            items = container.items() if isinstance(container, dict) else enumerate(container)
            for key, value in list(items) if isinstance(container, (dict, list)) else ():
                if any_symbolic(value):
                    container[key] = concrete(value)
        for g, name in program.global_stores:
            if any_symbolic(g.get(name)):
                g[name] = concrete(g[name])


def _plant_ints(fn: Callable, leaves: list[Any], sources: set[Source], tracer: Tracer) -> list[tuple]:
    """Make each int attribute at `sources` a symbol for the capture: the object holds a SymInt while the
    program runs (reads see it, arithmetic on it stays symbolic), and the graph takes its value as an input
    (a lifted placeholder read from the source per call). Returns what `_unplant` puts back."""
    import sympy
    from torch._dynamo.source import LocalSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    planted = []
    env = tracer.symbols.shape_env
    ctx, memo = CallContext([fn, *leaves], frame_function(fn)), {}
    with torch._C.DisableTorchFunction():
        for source in sorted(sources, key=lambda s: s.name()):
            if not isinstance(source, Attr):
                continue
            holder = source.base().resolve(ctx, memo)
            fields = getattr(holder, "__dict__", None)
            value = fields.get(source.attr) if isinstance(fields, dict) else None
            if type(value) is not int:
                continue
            name = identifier(source.name())
            symbol = env.create_symbol(value, source=LocalSource(name), dynamic_dim=DimDynamic.DUCK)
            if not isinstance(symbol, sympy.Symbol):
                continue  # 0 and 1 stay constants, as sizes do
            size = env.create_symintnode(symbol, hint=value, source=LocalSource(name))
            size._stampout_symbolic_int = True
            node = tracer.root.placeholder(name, size)
            tracer.symbols.bind_int(("lifted", len(tracer.lifted)), size, node)
            tracer.lifted.append((node, size, source))
            fields[source.attr] = size
            planted.append((fields, source.attr, value))
    return planted


def _unplant(planted: list[tuple]) -> None:
    for fields, name, value in planted:
        fields[name] = value


def _symbolic_names(tracer: Tracer, labels: list[str]) -> list[str]:
    """How a user names each symbolic input: its label, or the path to a tensor held by an input object."""
    names = []
    for key, _ in tracer.symbols.inputs:
        if type(key) is int:
            names.append(labels[key])
        else:
            _, t, source = tracer.lifted[key[1]]
            held = tracer.dynamic_tensors.get(id(t))
            names.append(held[2] if held is not None else source.name())
    return names


def _held_dynamic(fn: Callable, leaves: list[Any], sources: dict[Source, set[int]]) -> dict:
    """The tensors at `sources` (relative to the call) with the dims to capture symbolic."""
    found: dict[int, tuple[torch.Tensor, tuple[int, ...], str]] = {}
    ctx, memo = CallContext([fn, *leaves], frame_function(fn)), {}
    with torch._C.DisableTorchFunction():
        for source, dims in sources.items():
            t = source.resolve(ctx, memo)
            dims = tuple(sorted(d for d in dims if isinstance(t, torch.Tensor) and 0 <= d < t.dim()))
            if dims and id(t) not in found:
                found[id(t)] = (t, dims, source.name())
    return found


def _warn_unnamed(tracer: Tracer, program: RegionFrame | None) -> None:
    """A Capture reads every tensor from its source on each call: a tensor the capture could not name (held
    too deep in an object, by an object in a global) stays the capture's own — say so."""
    for node, t, found in tracer.lifted:
        if isinstance(t, torch.Tensor) and _lifted_source(t, found, program) is None:
            log.warning(message(
                f"the program reads a tensor of shape {tuple(t.shape)} (placeholder {node.name}) that stampout "
                "cannot name from the module, the call's arguments, closures or globals: the Capture keeps the "
                "tensor it saw, and later calls do not read it again",
                _read_at(node), "pass it as an argument, or hold it on the module (a buffer or attribute), "
                "or use stampout.compile (which reads such tensors per call or runs the program eagerly)",
            ))


def _read_at(node: Any) -> str:
    users = list(node.users)
    trace = users[0].meta.get("stack_trace", "") if users else ""
    return trace.strip().replace('File "', "").replace('", line ', ":") if trace else user_location()


def _lifted_source(t: torch.Tensor, found: Source | None, program: RegionFrame | None) -> Source | None:
    """Where each call finds a lifted tensor: the path the program read it through, else its name."""
    if program is not None and id(t) in program.sources:
        return program.sources[id(t)]
    return found


