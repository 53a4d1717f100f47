"""The world around one capture: the inputs' symbolic parts (tensors held by input objects with dynamic dims,
int attributes planted as symbols), how users name symbolic inputs and lifted tensors, and what a capture leaves
behind (random states and fakes put back, stores made concrete, tensors changed in place)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..context import listeners
from ..errors import CaptureError, message
from ..guards.guard import Guard, Kind
from ..guards.values import module_attr
from ..regions.call import RegionCalls
from ..regions.frame import ProgramIneligible, RegionFrame
from ..regions.marker import innermost
from ..sources import MISSING, Absolute, Arg, Attr, CallContext, Input, Source, mro_attr
from ..torch_internals import DisableTorchFunction, FakeTensor
from ..trace.frames import user_location
from ..trace.names import identifier, root_module
from ..trace.op_facts import drawn_at_random
from ..trace.shapes import Lifted, any_symbolic, concrete
from ..trace.tracer import Tracer
from ..watch.functools_caches import CacheReads
from ..watch.world import FieldsBefore, RandomStates, clear_fakes
from .held_inputs import Held
from .result import Capture

log = logging.getLogger("stampout.capture")


def frame_function(fn: Callable) -> Callable:
    """The Python function whose closures and globals a call of `fn` reads."""
    root = root_module(fn)
    if root is not None and fn is root:
        return innermost(type(root).forward)
    return getattr(fn, "__func__", fn)


def refuse_subclass(leaf: torch.Tensor, label: str, guard_program: bool) -> None:
    why = (f"takes a {type(leaf).__qualname__} as {label}, a torch.Tensor subclass stampout would trace as a plain "
           "tensor (isinstance checks and its methods would see the wrong class)")
    if guard_program:
        raise ProgramIneligible(why)
    raise CaptureError(message(f"stampout.capture cannot trace this program: {why}", user_location(),
                               "pass a plain tensor (x.as_subclass(torch.Tensor)), or use stampout.compile, which "
                               "runs such calls eagerly"))


def refuse_cached(cache: str, program: RegionFrame | None, filled: list[Any] = ()) -> None:
    """The program kept a traced value in a functools cache (see Note: functools caches in world_snapshot.py).
    Compile runs this call eagerly, which fills the caches (`filled`, as the capture left them) with eager's values:
    the next call, where they changed, captures again and hits them (their results then guarded, CacheReads), as
    eager keeps computing nothing anew (a later change of what they were computed from is not seen)."""
    why = (f"keeps a traced value in the functools cache of {cache}: eager computes it once and hits the cache "
           "afterwards, a graph would compute it again on every call")
    if program is not None:
        only_while = Guard(Absolute(CacheReads(list(filled)), "functools caches filled"), Kind.NAMESPACE, None,
                           "functools caches") if filled else None
        program.mark_ineligible(why, only_while=only_while)
        return
    raise CaptureError(message(f"stampout.capture cannot trace this program: it {why}", user_location(),
                               "compute the cached value before the capture (call the function once), or use "
                               "stampout.compile, which runs such a call eagerly"))


def drawn_store(tracer: Tracer, left: list[tuple[Any, Any, str]], values: list[Any],
                made: Callable[[], list[torch.nn.Module]]) -> str | None:
    """Why the capture is refused, if a value the program stores in state that outlives the call
    (`self._noise = torch.randn(...)` behind an `is None` test) is drawn at random: the graph computes it on every
    call of the Capture, drawing it again, where eager draws it once and reuses it (`compile` captures again once
    it is stored). `made()`: modules the call made (`Block()(x)`: eager draws their weights on every call too), whose
    registries are no such state (asked only for a drawn value)."""
    made_ids: set[int] | None = None
    for (holder, key, _), value in zip(left, values):
        node = tracer.root.nodes.get(id(value))
        if node is not None and drawn_at_random(node[1], tracer.root.submodules):
            if made_ids is None:
                made_ids = {id(part) for m in made() for part in (m, *m.__dict__.values())}
            if id(holder) in made_ids:
                continue
            name = f"{type(holder).__name__}.{key}" if not isinstance(holder, (dict, list)) else f"the item {key!r}"
            return message(
                f"stampout.capture cannot trace this program: it stores a tensor drawn at random in {name}, which "
                "each call of the Capture would draw again (eager draws it once, then reuses what it stored)",
                _read_at(node[1]), "draw it before the capture (in __init__, or one eager call), or use "
                "stampout.compile, which reads it once stored")
    return None


def mutated_in_place(tracer: Tracer, leaves: list[Any], cap: Capture) -> list[torch.Tensor]:
    """The real tensors of the program's own state (buffers, parameters, globals) it changed in place, by their
    fakes' versions. Not the inputs' tensors (a KV cache's): the objects the caller passed are left as one eager
    call leaves them, Python state and tensors together."""
    inputs = {id(t) for t in leaves if isinstance(t, torch.Tensor)}
    inputs.update(id(t) for t, source in cap.lifted if source is not None and _from_the_inputs(source))
    return list({id(t): t for t, f in tracer._fakes.values()
                 if not f.is_inference() and f._version > 0  # (an inference tensor keeps no version)
                 and not isinstance(t, FakeTensor) and id(t) not in inputs}.values())


def _from_the_inputs(source: Source) -> bool:
    """Whether `source` starts at an input of the call (leaf 0 of a call context is the program itself)."""
    while source.base() is not None:
        source = source.base()
    return isinstance(source, Input) or (isinstance(source, Arg) and source.index != 0)


def restore_world(handler: RegionCalls, states: RandomStates | None, objects: list[Any],
                  before: FieldsBefore | None = None, clean: dict[int, Any] | None = None) -> str:
    """Put back the random generators, and take every fake tensor and symbolic size out of what the program's
    code could reach (globals, memo caches, class dicts; the attributes of `objects`, put back as `before` noted
    them before the program ran). Returns what held
    traced values other than in caches (empty: nothing). `clean`: objects a whole walk for any traced value just went
    through without finding one (see clear_fakes). See world.py."""
    if states is not None:
        states.restore()
    with DisableTorchFunction():
        repairs = handler.snapshot.repair()
        repairs.places.extend(clear_fakes(objects, before=before, clean=clean))
    if repairs.caches or repairs.places:
        log.info("after the capture: put right %s", repairs.describe())
    return ", ".join(repairs.places)


def concrete_stores(program: RegionFrame, held: Held) -> None:
    """What the captured Python stored (attributes, list and dict items, globals) holds no symbolic size
    afterwards: each has its value for the capture's own inputs, as one eager call leaves it. (Stores on the
    input objects are the Capture's to repeat per call, computed by the graph: see `input_stores`.)"""
    with DisableTorchFunction(), listeners(None, None):
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


def plant_ints(fn: Callable, leaves: list[Any], sources: set[Source], tracer: Tracer) -> list[tuple]:
    """Make each int attribute at `sources` a symbol for the capture: the object holds a SymInt while the
    program runs (reads see it, arithmetic on it stays symbolic), and the graph takes its value as an input
    (a lifted placeholder read from the source per call). Returns what `unplant` puts back."""
    import sympy
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    from ..torch_internals import LocalSource

    planted = []
    env = tracer.symbols.shape_env
    ctx, memo = CallContext([fn, *leaves], frame_function(fn)), {}
    with DisableTorchFunction():
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
            tracer.symbols.bind_int(Lifted(len(tracer.lifted)), size, node)
            tracer.lifted.append((node, size, source))
            fields[source.attr] = size
            planted.append((fields, source.attr, value))
    return planted


def unplant(planted: list[tuple]) -> None:
    for fields, name, value in planted:
        fields[name] = value


def symbolic_names(tracer: Tracer, labels: list[str]) -> list[str]:
    """How a user names each symbolic input: its label, or the path to a tensor held by an input object."""
    names = []
    for key, _ in tracer.symbols.inputs:
        if type(key) is int:
            names.append(labels[key])
        else:
            _, t, source = tracer.lifted[key.position]
            held = tracer.dynamic_tensors.get(id(t))
            names.append(held[2] if held is not None else source.name())
    return names


def held_dynamic(fn: Callable, leaves: list[Any], sources: dict[Source, set[int]]) -> dict:
    """The tensors at `sources` (relative to the call) with the dims to capture symbolic."""
    found: dict[int, tuple[torch.Tensor, tuple[int, ...], str]] = {}
    ctx, memo = CallContext([fn, *leaves], frame_function(fn)), {}
    with DisableTorchFunction():
        for source, dims in sources.items():
            t = source.resolve(ctx, memo)
            dims = tuple(sorted(d for d in dims if isinstance(t, torch.Tensor) and 0 <= d < t.dim()))
            if dims and id(t) not in found:
                found[id(t)] = (t, dims, source.name())
    return found


def warn_unnamed(tracer: Tracer, program: RegionFrame | None) -> None:
    """A Capture reads every tensor from its source on each call: a tensor the capture could not name (held
    too deep in an object, by an object in a global) stays the capture's own — say so."""
    for node, t, found in tracer.lifted:
        if isinstance(t, torch.Tensor) and lifted_source(t, found, program) is None:
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


def lifted_source(t: torch.Tensor, found: Source | None, program: RegionFrame | None) -> Source | None:
    """Where each call finds a lifted tensor: the path the program read it through, else its name."""
    if program is not None and id(t) in program.sources:
        return program.sources[id(t)]
    return found


class ModulePaths:
    """`source.resolve(ctx, memo)` for many paths through one module tree (a deep model's lifted parameters, each
    `self.layers[i].attn.qkv.weight`): a step from a module whose class resolves attributes as nn.Module does (no
    `__getattr__`/`__getattribute__` of its own) to a name its class does not define reads the instance dict and
    the registries, as nn.Module resolves it (guards.values.module_attr), without the failed lookup and
    `nn.Module.__getattr__` call per step; the parents shared by many paths are resolved once (by identity: the
    capture's sources share them). Any other step is the source's own resolve."""

    __slots__ = ("ctx", "memo", "values", "plain")

    def __init__(self, ctx: CallContext) -> None:
        self.ctx, self.memo = ctx, {}
        self.values: dict[int, tuple[Source, Any]] = {}  # id(source) -> (source, its value): the source kept alive
        self.plain: dict[tuple[type, str], bool] = {}

    def __call__(self, source: Source) -> Any:
        hit = self.values.get(id(source))
        if hit is not None:
            return hit[1]
        value = MISSING
        if type(source) is Attr:
            obj = self(source.parent)
            cls, attr = type(obj), source.attr
            plain = self.plain.get((cls, attr))
            if plain is None:
                plain = self.plain[(cls, attr)] = (issubclass(cls, torch.nn.Module)
                                                   and cls.__getattr__ is torch.nn.Module.__getattr__
                                                   and cls.__getattribute__ is object.__getattribute__
                                                   and mro_attr(cls, attr) is MISSING)
            if plain:
                value = module_attr(obj, attr)
        if value is MISSING:  # (the general step; a missing attribute is MISSING there too)
            value = source.resolve(self.ctx, self.memo)
        self.values[id(source)] = (source, value)
        return value
