"""What a capture's inputs hold: the objects and containers reachable from the arguments (watched, guarded and
replayed as the inputs' own state), the stores the program makes into them, and the inputs rebuilt around new
leaves."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch

from ..errors import CaptureError, message
from ..guards.guard import Kind, is_constant
from ..regions.frame import RegionFrame
from ..regions.objects import program_fields
from ..sources import Arg, Attr, Input, Item, Place, Source
from ..torch_internals import FakeTensor
from ..trace.frames import user_location
from ..trace.shapes import SIZES
from ..trace.structure import ATOMIC, fakes_within, opened_dict, positional_names, template_constants
from ..trace.tracer import Tracer
from .effects import Plan, Value, ValueKind, put_back


def hold_input_containers(held: Held, signature_of: Callable, fn: Callable, args: tuple, kwargs: dict) -> None:
    names = positional_names(signature_of)
    if isinstance(fn, torch.nn.Module) or inspect.ismethod(fn):
        names = names[1:]

    def walk(value: Any, source: Source) -> None:
        if type(value) in (list, dict, set) or isinstance(value, dict):  # (an OrderedDict, a defaultdict too)
            dict.__setitem__(held, id(value), (value, source))
        if type(value) in (list, tuple) or isinstance(value, dict):
            for k, item in (value.items() if isinstance(value, dict) else enumerate(value)):
                walk(item, Item(source, k))

    for i, value in enumerate(args):
        walk(value, Input(i, names[i] if i < len(names) else f"args[{i}]"))
    for key, value in kwargs.items():
        walk(value, Input(key, key))


def in_input_container(source: Source) -> bool:
    while source.base() is not None:
        source = source.base()
    return isinstance(source, Input)


def note_input_containers(program: RegionFrame, signature_of: Callable, fn: Callable, args: tuple,
                           kwargs: dict) -> None:
    """The lists and dicts the call was given (a KV cache dict the program fills): effects on them are planned
    on the call's own containers, found by position (`Input`)."""
    names = positional_names(signature_of)
    if isinstance(fn, torch.nn.Module) or inspect.ismethod(fn):
        names = names[1:]
    for i, value in enumerate(args):
        program.note_input_containers(value, Input(i, names[i] if i < len(names) else f"args[{i}]"))
    for key, value in kwargs.items():
        program.note_input_containers(value, Input(key, key))


def object_fields(obj: Any) -> dict:
    """What `obj` holds, by key: a dict's items, a list's by index, a set's members by identity, an object's
    attributes."""
    if isinstance(obj, (set, frozenset)):
        return {id(v): v for v in obj}
    return dict(obj) if isinstance(obj, dict) else dict(enumerate(obj)) if isinstance(obj, list) else dict(vars(obj))


def input_stores(held: Held, before: dict[int, dict], tracer: Tracer, plan: Plan) -> tuple[list, str]:
    """What the program changed on its input objects (`cache.layers[0].keys = cat(...)`,
    `layer.is_initialized = True`), as stores each call of the capture repeats on its own objects: (holder
    source, key, Place, Value). Tensors become extra outputs; a change that cannot be repeated (an
    object made during the call, an item removed) is described in the second result."""
    stores: list = []
    unreplayable = ""
    nodes = tracer.root.nodes
    for obj in held:
        old, new = before[id(obj)], object_fields(obj)
        kind = Place.ATTR if not isinstance(obj, (list, dict)) else Place.ITEM
        source = held[obj]
        if (any(k not in new for k in old) or (isinstance(obj, list) and len(new) != len(old))
                or isinstance(obj, set) and new.keys() != old.keys()):
            unreplayable = unreplayable or f"changes the items of {source.name()}"
            continue
        for key, value in new.items():
            if key in old and old[key] is value:
                continue
            if type(value) is FakeTensor and id(value) in nodes or isinstance(value, (torch.SymInt, torch.SymFloat)):
                plan.extra.append(value)  # (a symbolic size too: its value for each call comes from the graph)
                stores.append((source, key, kind, Value(ValueKind.OUT, len(plan.extra) - 1)))
            elif is_constant(value) and type(value) not in (list, dict, set):
                stores.append((source, key, kind, Value(ValueKind.CONST, value)))
            elif value in held:
                stores.append((source, key, kind, Value(ValueKind.SOURCE, held[value])))
            else:
                made = f"stores a {type(value).__name__} made during the call on {source.name()}"
                unreplayable = unreplayable or made
    return stores, unreplayable


def copy_back_given_containers(held: Held, ctx: Any) -> list[str]:
    """The lists and dicts the call was given (the program ran on copies of them), as the program left its
    copies: a capture whose change to them cannot be repeated still leaves them as one eager call does. An item
    that still holds a traced tensor (inside an object the graph does not compute: `acc.append(Fn(t))`) is left
    out; returns the containers that lost one (the capture is refused)."""
    lost = []
    for obj in held:
        source = held[obj]
        if type(obj) in (list, dict) and in_input_container(source):
            original = source.resolve(ctx, {})
            if original is not obj and type(original) is type(obj):
                items = list(obj.items()) if type(obj) is dict else list(enumerate(obj))
                kept = [(k, v) for k, v in items if not fakes_within(k) and not fakes_within(v)]
                if len(kept) < len(items):
                    lost.append(source.name())
                put_back(original, [v for _, v in kept] if type(obj) is list else dict(kept))
    return lost


def input_objects(leaves: list[Any]) -> dict[int, int]:
    """id -> leaf index of the inputs that are objects (a KV cache): returned as the call's own object."""
    return {id(leaf): i for i, leaf in enumerate(leaves)
            if not isinstance(leaf, torch.Tensor) and not is_constant(leaf) and not callable(leaf)}


class Held(dict):
    """Objects reachable from a call's input objects (attributes, list and dict items), by identity, with their
    sources relative to `[fn, *inputs]`."""

    def __contains__(self, obj: object) -> bool:
        return dict.__contains__(self, id(obj))

    def get(self, obj: Any, default: Any = None) -> Any:
        hit = dict.get(self, id(obj))
        return default if hit is None else hit[1]

    def __getitem__(self, obj: Any) -> Source:
        return dict.__getitem__(self, id(obj))[1]

    def __iter__(self):
        return iter([obj for obj, _ in self.values()])


def held_map(leaves: list[Any], labels: list[str], depth: int = 3) -> Held:
    held = Held()

    def walk(obj: Any, source: Source, level: int) -> None:
        if id(obj) in held.keys() or level > depth:
            return
        if type(obj) is set:  # (its members have no key to reach them by: a change is seen, not repeated)
            dict.__setitem__(held, id(obj), (obj, source))
            return
        if type(obj) in (list, dict):  # (even empty: the call may fill it)
            dict.__setitem__(held, id(obj), (obj, source))
            for k, v in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
                walk(v, Item(source, k), level + 1)
            return
        if isinstance(obj, (torch.Tensor, torch.nn.Module, type, *SIZES)) or is_constant(obj) or callable(obj):
            return
        if isinstance(obj, (list, dict)):
            dict.__setitem__(held, id(obj), (obj, source))
            for k, v in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
                walk(v, Item(source, k), level + 1)
            return
        fields = getattr(obj, "__dict__", None)
        if type(fields) is not dict:
            return
        dict.__setitem__(held, id(obj), (obj, source))
        for key, value in list(fields.items()):
            walk(value, Attr(source, key), level + 1)

    for i, (leaf, label) in enumerate(zip(leaves, labels)):
        if id(leaf) in input_objects(leaves):
            walk(leaf, Arg(i + 1, label), 0)
    return held


def held_by_inputs(leaves: list[Any], labels: list[str]) -> list[Any]:
    """The objects and containers the call's input objects reach (what the program may change on them)."""
    return list(held_map(leaves, labels))


def check_no_output_fields(holes: list[Any], tracer: Tracer) -> None:
    """An output tensor the program computed and set Python attributes on (`y.tag = ...`; not an input or a
    parameter handed back): each call's output is a new tensor without them, so the capture refuses (compile runs
    such a program eagerly)."""
    for t in holes:
        fields = getattr(t, "__dict__", None) if isinstance(t, torch.Tensor) else None  # (not a SymInt's .node)
        if not fields or tracer.root.node_for(t).op == "placeholder":
            continue
        names = program_fields(fields)
        if names:
            raise CaptureError(message(
                f"the program sets Python attributes on an output tensor ({', '.join('.' + k for k in names[:3])}): "
                "the outputs of a captured graph's calls are new tensors, without them", user_location(),
                "return those values beside the tensor (a tuple or a dict), or use stampout.compile, which runs such "
                "a program eagerly"))


def check_no_hidden_tensors(template: Any, held: Any = ()) -> None:
    """An output value that carries traced tensors where stampout cannot see them (a KV-cache object, a module it
    made, a closure, a partial) would hand fake tensors to the caller on every call: refuse it. Every value the
    output's constants reach is looked at (structure.fakes_within). A list or dict of the world's (`held`, see
    keep_held_outputs) is left alone: what the trace changed in it is undone and replayed with real values."""
    for value in template_constants(template):
        if type(value) in ATOMIC or id(value) in held and isinstance(value, (list, dict, set)) \
                or not fakes_within(value):
            continue
        fields = getattr(value, "__dict__", None)
        names = [k for k, v in fields.items() if fakes_within(v)] if type(fields) is dict else []
        where = f" whose .{names[0]}" if names else " that"
        raise CaptureError(message(
            f"the output holds a {type(value).__name__}{where} carries traced tensors; "
            "stampout returns tensors only inside tuples, lists, dicts, dataclasses and ModelOutputs",
            user_location(),
            "return the tensors themselves, or pass the object in (for Hugging Face models, pass "
            "past_key_values=DynamicCache(config=model.config) or a StaticCache, or use_cache=False)",
        ))


def rebuild_inputs(args: tuple, kwargs: dict, leaves: list[Any]) -> tuple[tuple, dict]:
    """`(args, kwargs)` with the flat leaves of `flatten_inputs` replaced by `leaves`."""
    it = iter(leaves)

    def walk(value: Any) -> Any:
        t = type(value)
        if t is tuple or t is list:
            return t(walk(v) for v in value)
        if isinstance(value, tuple) and hasattr(t, "_fields"):
            return t(*(walk(v) for v in value))
        if t is dict and opened_dict(value):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, dict) and opened_dict(value):  # a dict subclass (OrderedDict, ModelOutput): a copy with
            # the new items
            new = copy.copy(value)
            for k, v in value.items():
                new[k] = walk(v)
            return new
        return next(it)

    return tuple(walk(a) for a in args), {k: walk(v) for k, v in kwargs.items()}


_SHARED_KINDS = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def held_containers(program: RegionFrame) -> dict[int, Source]:
    """id -> source of the objects the program read from the world (see to_template) and of the lists, dicts and
    sets it read or was given (they outlive the call: returned, they are the caller's own, not copies)."""
    held = {**program.sources, **{id(c): source for c, source, *_ in program.containers}}
    for made in program.made:  # (what the trace itself made and stored: `self.hist = self.hist + [y]`)
        held.pop(made, None)
    return held


def keep_held_outputs(template: Any, program: RegionFrame, held: dict[int, Source]) -> None:
    """A list, dict or set the program returns that it read from the world (`return y, self.history`) is that very
    object in every compiled call's output, guarded to stay the object at its source; one the call was given
    (`xs.append(y); return xs`) is each call's own, which the output cannot name: that program runs eagerly."""
    for value in template_constants(template):
        source = held.get(id(value)) if type(value) in (list, dict, set) or isinstance(value, dict) else None
        if source is None:
            continue
        root = source
        while root.base() is not None:
            root = root.base()
        if type(root) is Input or type(root) is Arg and root.index != 0:  # (Arg 0: the program itself)
            program.mark_ineligible(f"returns the {type(value).__name__} it was given at {source.name()} (eager "
                                    "returns that object; a compiled call's output cannot name it)")
            return
        program.guard(source, Kind.ID, value)


def refuse_stored_outputs(out: Any, program: RegionFrame, held: dict[int, Source]) -> None:
    """A list, dict or set the call made that it both stores where it outlives the call and returns (`self.hist =
    self.hist + [y]; return y, self.hist`): eager returns the stored object, a compiled call would return a copy beside
    the one its replayed store makes. Such a program runs eagerly."""
    returned = _made_containers(out, held)
    if not returned:
        return
    stored = [value for _, _, value, *_ in program.stores]
    stored += [dict.values(c) if isinstance(c, dict) else c for c, *_ in program.containers]
    if _made_containers(stored, held).keys() & returned.keys():
        program.mark_ineligible("stores a list, dict or set it made where it outlives the call and returns it too "
                                "(eager returns that object; a compiled call would return a copy)")


def _made_containers(value: Any, held: Any, found: dict[int, Any] | None = None, depth: int = 0) -> dict[int, Any]:
    """id -> object of the lists, dicts and sets `value` reaches (through lists, tuples, dicts, sets, dataclasses) that
    are not in `held`."""
    found = {} if found is None else found
    if depth > 8 or isinstance(value, (torch.Tensor, str, bytes)):
        return found
    if isinstance(value, (list, dict, set)) and id(value) not in held:
        if id(value) in found:
            return found
        found[id(value)] = value
    if isinstance(value, dict) or type(value) is type({}.values()):
        items = dict.values(value) if isinstance(value, dict) else value
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = getattr(value, "__dict__", {}).values()
    else:
        return found
    for item in list(items):
        _made_containers(item, held, found, depth + 1)
    return found


def refuse_made_outputs(template: Any, program: RegionFrame) -> None:
    """An output object the program made during the call (a user object, a partial; not a tensor, a constant, a
    list or dict, which are made anew per call, or an object it read from the world) would be the template's constant:
    one object shared by every compiled call, where eager makes a new one each call (a caller's change to it would
    show in the next call's output). Such a program runs eagerly."""
    for value in template_constants(template):
        if type(value) in ATOMIC or isinstance(value, _SHARED_KINDS) or id(value) in program.sources:
            continue
        if not is_constant(value):
            program.mark_ineligible(f"returns a {type(value).__name__} made during the call (eager makes a new one "
                                    "each call; a compiled call would return the same one)")
            return
