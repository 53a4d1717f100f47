"""RegionFrame: what one region trace read, as guards on sources relative to the call's arguments.

Fail closed: every value the traced Python reads is guarded by value (constants), metadata (tensors),
identity (functions, classes) or by watching its reads (objects whose class can carry a shim); a value
that fits none of these makes the trace ineligible for reuse.
"""

from __future__ import annotations

import collections
import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .. import config
from ..guards.guard import Guard, Kind, const_key, hooks_key, is_constant, tensor_meta
from ..guards.namespaces import ABSENT_NAME, class_dict, patched_tensor_methods
from ..sources import MISSING, Absolute, Arg, Attr, ClassAttr, Input, Item, Source, TypeOf, mro_attr
from ..torch_internals import FakeTensor
from ..trace.code import user_hashed_key
from ..trace.frames import user_location
from ..trace.shapes import SIZES, size_key
from ..watch.classpatch import PATCHED_NAMES, shimmed
from ..watch.tracking import Watch, original_class
from .cache import LiftedInput
from .events import Ineligible
from .frame_code import FrameCode
from .frame_indices import FrameIndices
from .frame_nested import FrameNested
from .frame_writes import FrameWrites
from .objects import (
    BY_IDENTITY,
    CONTAINERS,
    accepted_types,
    class_set,
    found_on_class,
    hidden_state,
    instance_fields,
    is_user_class,
    is_user_class_object,
    meta_key,
    program_fields,
    raw_meta,
    served_by_getattr,
)


class ProgramIneligible(BaseException):  # noqa: N818 - control flow, not an error (user code must not catch it)
    """Raised out of the program a compile captures as soon as its frame is ineligible: the program will run
    eagerly, and the rest of the capture would only consume state (an iterator, an RNG) eager must see."""

    def __init__(self, reason: str, only_while: Guard | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.only_while = only_while  # the reason holds only while this guard passes (a later call may capture)


# nn.Module's walks of its registries (the children's, or the whole tree's) and the other registry each reads
_TREE_WALKS = {"children": (), "named_children": (), "modules": (), "named_modules": (), "parameters": ("_parameters",),
               "named_parameters": ("_parameters",), "buffers": ("_buffers",), "named_buffers": ("_buffers",)}
_METHODS = (types.FunctionType, classmethod, staticmethod, property, functools.partialmethod)


def _by_identity(key: Any) -> bool:
    """A dict key equal only to itself (a module, an object of a class without `__eq__`, a weak reference)."""
    return type(key) is weakref.ref or (type(key).__hash__ is object.__hash__ and not isinstance(key, type))


# (how a container's class reads its items: see _guard_protocol)
_CONTAINER_PROTOCOL = ("__iter__", "__len__", "__getitem__", "__contains__")
_MODULE_SLOTS = ("__call__", "__getattr__")  # (how `m(x)` reaches the module's forward, `m.l` its children)

class RegionFrame(FrameWrites, FrameCode, FrameIndices, FrameNested):
    """Reads recorded while one region call is traced, and why its trace may not be reusable.

    The guards and the sources of the objects read live here; each mixin keeps its own part and sets its
    attributes in its `_begin_*`: FrameWrites (stores, containers, input tensors' fields, global stores),
    FrameCode (the code that ran: cells, defaults, globals, module chains), FrameIndices (per-layer indices),
    FrameNested (nested entries stamped out)."""

    def __init__(self, fn: Callable, leaves: list[Any], labels: list[str], watch: Watch,
                 program: bool = False, input_tensors: dict[int, str] | None = None) -> None:
        self.fn = fn
        self.program = program  # the whole program's frame (compile): its stores are replayed, not refused
        self.leaves = leaves
        self.labels = labels
        self.watch = watch
        self.sources: dict[int, Source] = {}
        self._keep: list[Any] = []
        self._objects: list[tuple[Any, Source]] = []  # modules and objects read, then dict keys held by identity
        # a compiled program's real input tensors (the trace gets fakes; before adopt_function below: the globals
        # its code names are read there)
        self.input_tensors: dict[int, str] = input_tensors or {}
        self._held_tensors: list[tuple[torch.Tensor, Source]] = []  # (and the other tensors it read: not those)
        self.guards: list[Guard] = []
        self._guarded: set[tuple[Source, Kind]] = set()
        self.ineligible: list[Ineligible] = []
        self.reads_requires_grad = False
        self._classes: set[type] = set()
        self._slot_classes: set[tuple[type, tuple[str, ...]]] = set()  # (see _guard_class_names)
        self._class_dicts: dict[int, type] = {}  # id(class dict) -> the class (see _under_patch)
        self.states: list[tuple[Any, Any]] = []  # (object, getstate()) of opaque objects the trace read
        self.lifted: list[LiftedInput] = []
        self.cache_misses: dict[int, int] = {}  # functools caches known when the trace began: misses then
        self.world_state: dict[int, tuple] = {}  # what the memo containers and module globals held then
        self.abandon = False  # raise ProgramIneligible when made ineligible (a compiled program's frame)
        self._begin_writes(leaves)
        self._begin_code()  # (before the arguments are adopted: a user module among them is read by name)
        self._begin_indices()
        self._begin_nested()
        for i, leaf in enumerate(leaves):
            if not is_constant(leaf):
                if not isinstance(leaf, torch.Tensor):
                    watch.arguments.add(id(leaf))
                self.adopt(leaf, Arg(i, labels[i]), from_arg=True)
        self._input_meta = [(i, raw_meta(t)) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        self.guard(Absolute(self.namespaces, "names read in modules"), Kind.NAMESPACE, None, "module attributes")
        for name in patched_tensor_methods():
            self.mark_ineligible(f"runs with torch.Tensor.{name} replaced by a Python function (stampout traces "
                                 "torch's own methods only)")
        self.adopt_function(fn, None)
        if not program:  # (a region's input tensor tagged by the caller's Python, `x.scale = s`: its values)
            for i, _, before in self._input_fields:
                for k in program_fields(before):
                    self.adopt(before[k], Item(Attr(Arg(i, labels[i]), "__dict__"), k), where="attributes of an input")

    # ---- recording ------------------------------------------------------------------------------
    def guard(self, source: Source, kind: Kind, expected: Any, where: str = "") -> None:
        if (source, kind) not in self._guarded:
            self._guarded.add((source, kind))
            self.guards.append(Guard(source, kind, expected, where or user_location(3)))

    def _name(self, obj: Any, source: Source, where: str = "") -> bool:
        """Remember where `obj` was found; a second path to it is guarded to lead to the same object.
        Returns True when the object was new to this frame."""
        known = self.sources.get(id(obj))
        if known is None:
            self.sources[id(obj)] = source
            self._keep.append(obj)
            return True
        if known != source:
            self.guard(source, Kind.SAME, known, where)
            if self.slots is not None:
                self.slots.second_name(obj)
        return False

    def adopt(self, value: Any, source: Source, from_arg: bool = False, where: str = "") -> None:
        """Guard `value`, found at `source`, and remember the source of objects read through it."""
        if value is MISSING:
            self.guard(source, Kind.ABSENT, MISSING, where)
        elif isinstance(value, torch.Tensor):
            if not from_arg:
                self.guard(source, Kind.TENSOR, tensor_meta(value), where)
                if id(value) in self.input_tensors:  # (`if self._last[0] is x: return self._cached`: False here)
                    label = self.input_tensors[id(value)]  # (eager only while it is: a call where it is not captures)
                    self.mark_ineligible(f"reads at {source.name()} the tensor it is given as {label} (the trace "
                                         "sees two tensors, eager one)", only_while=Guard(
                                             source, Kind.SAME, Arg(self.labels.index(label), label), where))
                elif self.input_tensors and not isinstance(value, torch.nn.Parameter):
                    self._held_tensors.append((value, source))
            if self._name(value, source, where):
                self._adopt_tensor_attributes(value, source, where)
        elif is_constant(value):
            if not from_arg:
                self.guard(source, Kind.CONST, const_key(value), where)
            if type(value) in (list, dict, set):  # mutable: changing it in the trace is a side effect
                self._note_container(value, source, where)
        elif isinstance(value, SIZES):
            if from_arg:
                pass  # (an argument's expression is in the fingerprint)
            elif getattr(value, "_stampout_symbolic_int", False):  # an int attribute the capture made a symbol
                self.guard(source, Kind.SIZE, size_key(value), where)
            else:  # a size held by an object: nothing to guard it by
                self.mark_ineligible(f"reads {source.name()}, a symbolic size held outside its arguments")
        elif isinstance(value, torch.nn.Module):
            self._adopt_module(value, source, from_arg, where)
        elif isinstance(value, types.FunctionType):  # (the program itself: its attributes are read by name)
            self._adopt_callable(value, source, where, fields=not (from_arg and value is self.fn))
        elif isinstance(value, types.MethodType):
            self.adopt(value.__func__, Attr(source, "__func__"), where=where)
            self.adopt(value.__self__, Attr(source, "__self__"), where=where)
        elif type(value) is functools.partial:
            self.guard(source, Kind.TYPE, (functools.partial,), where)
            for part in ("func", "args", "keywords"):
                self.adopt(getattr(value, part), Attr(source, part), where=where)
        elif isinstance(value, (property, staticmethod, classmethod)):
            self.adopt_descriptor(value, source, where)
        elif isinstance(value, BY_IDENTITY) or type(value) is object:  # (`_MISSING = object()`: no state at all)
            self.guard(source, Kind.ID, value, where)
            if isinstance(value, types.ModuleType):  # (reached as a value: any of its attributes may be read)
                self._note_user_namespace(value)
            elif isinstance(value, type):  # (`cfg.scale`, `Cfg.act(x)` on the class itself, or called: its
                # `__init__` runs; no watch sees what its namespace holds being read)
                self.adopt_class_value(value, where)
        elif isinstance(value, (list, tuple, dict)):
            self._adopt_container(value, source, where)
        elif class_set(value):
            self.guard(source, Kind.MEMBERS, tuple(value), where)
            if type(value) is set:  # (mutable: adding to it in the trace is a side effect)
                self._note_container(value, source, where)
        elif not hidden_state(type(value)) and self.watch.watch(value):
            if not from_arg:
                self.guard(source, Kind.TYPE, accepted_types(value), where)
            if self._name(value, source, where):
                self._objects.append((value, source))
                self._adopt_class(original_class(value), where)
        else:
            self.guard(source, Kind.ID, value, where)
            if callable(getattr(value, "getstate", None)) and callable(getattr(value, "setstate", None)):
                self.states.append((value, value.getstate()))  # a random.Random: put back after the capture
            self.mark_ineligible(
                f"reads {source.name()}, a {type(value).__name__} whose state stampout cannot guard"
            )

    def _adopt_module(self, value: torch.nn.Module, source: Source, from_arg: bool, where: str) -> None:
        # (an argument's class is in the fingerprint too; the guard lets the guard code read it fast)
        self.guard(source, Kind.TYPE, accepted_types(value), where)
        hooks = hooks_key(value)
        self.guard(source, Kind.HOOKS, hooks, where)
        self.note_hooks(value, hooks, source)
        if not self._name(value, source, where):
            return
        self._objects.append((value, source))
        self.watch.watch(value)
        self._adopt_class(original_class(value), where)
        # (`m(x)` and `for layer in self.layers` go through type slots, with no attribute read to guard: what the
        # module's class, library classes included, finds for them by name; `nn.Module.__call__ = ...` between calls)
        self._guard_class_names(original_class(value), _MODULE_SLOTS + (
            _CONTAINER_PROTOCOL if isinstance(value, CONTAINERS) else ()))
        if isinstance(value, CONTAINERS):
            self._adopt_children(value, source, where)

    def _guard_class_names(self, cls: type, names: tuple[str, ...]) -> None:
        """Each of `names` as `cls`'s MRO finds it, in the NamespaceReads (a key lookup each per call: nn.Module's
        dict is written by piecewise runs): the object in the class that defines it, absent from those before."""
        if (cls, names) in self._slot_classes:
            return
        self._slot_classes.add((cls, names))
        for name in names:
            for klass in cls.__mro__:
                if klass is object:
                    break
                patched, own = shimmed(klass, name)
                if patched:  # (stampout's attribute watch, there during captures: what it calls is the rest of the MRO,
                    if own is MISSING:  # looked up when the capture patches the class)
                        continue
                    break  # (the user's own method, guarded with the class's, _adopt_class)
                fields = class_dict(klass)
                self._class_dicts[id(fields)] = klass
                self.namespaces.note_lookup(fields, klass.__qualname__, name, fields.get(name, ABSENT_NAME))
                if name in fields:
                    break

    def _under_patch(self, fields: dict, name: str) -> Any:
        """What class dict `fields` held for `name` before stampout's attribute watch patched its class during this
        capture (ABSENT_NAME: nothing), or None where no patch of ours holds it (see _guard_class_names)."""
        klass = self._class_dicts.get(id(fields))
        patched, own = shimmed(klass, name) if klass is not None else (False, None)
        return (ABSENT_NAME if own is MISSING else own) if patched else None

    def _adopt_class(self, cls: type, where: str) -> None:
        """What a user class defines (defaults, methods, classmethods' data): a class attribute changed
        between calls, or a method swapped on the class, changes what its instances compute."""
        for klass in cls.__mro__:
            if klass in self._classes or not is_user_class_object(klass):
                continue
            self._classes.add(klass)
            namespace = Attr(Absolute(klass, klass.__qualname__), "__dict__")
            fields = class_dict(klass)
            for name, value in list(fields.items()):
                if name in PATCHED_NAMES or name == "_abc_impl":  # (an ABC's registry: `abc`'s bookkeeping)
                    continue
                # Dunder methods too (`act(x)` calls `__call__`, `table[3]` `__getitem__`, `Klass()` `__init__`:
                # through type slots, with no attribute read to guard); dunder data (`__module__`, `__dict__`,
                # dataclass tables) is the class's own bookkeeping.
                if (name.startswith("__") and name.endswith("__")) and not isinstance(value, _METHODS):
                    continue
                if type(value) is types.FunctionType and any(not k.startswith("__") for k in vars(value)):
                    # (a method with attributes of its own: guarded with them)
                    self._adopt_callable(value, Item(namespace, name), where)
                elif not self.note_by_identity(fields, klass.__qualname__, name, value, Item(namespace, name)):
                    self.adopt(value, Item(namespace, name), where=where)

    def adopt_class_value(self, cls: type, where: str) -> None:
        """A class reached as a value (`cfg.scale`, `Cfg.act(x)` on the class itself, or called: its `__init__`
        runs; no watch sees what its namespace holds being read)."""
        self._adopt_class(cls, where)
        self._guard_unshadowed(cls, where)
        if type(cls) is not type:  # (a user metaclass: its properties, `Cfg.shift`)
            self._adopt_class(type(cls), where)

    def _guard_unshadowed(self, cls: type, where: str) -> None:
        """A class reached as a value (`Helper.scale`, `self.kind.make(x)`) reads names along its MRO with no watch:
        its `__mro__` by identity (`__bases__` assigned), and each name a user base class or metaclass defines as
        absent from the user classes before it (`Helper.scale = 2.0` shadows `Base.scale`), in the NamespaceReads."""
        self.guard(Attr(Absolute(cls, cls.__qualname__), "__mro__"), Kind.ID, cls.__mro__, where)
        mro = [k for k in cls.__mro__ if is_user_class_object(k)]
        meta = [k for k in type(cls).__mro__ if is_user_class_object(k)]  # (`Cfg.factor` found on its metaclass)
        for i, klass in [*enumerate(mro[1:], 1), *((len(mro), k) for k in meta)]:
            for name in class_dict(klass):
                if name not in PATCHED_NAMES and not (name.startswith("__") and name.endswith("__")):
                    for earlier in mro[:i]:
                        if name not in earlier.__dict__:
                            self.namespaces.note(class_dict(earlier), earlier.__qualname__, name, ABSENT_NAME)

    def _adopt_tensor_attributes(self, t: torch.Tensor, source: Source, where: str) -> None:
        """Python attributes set on a tensor (`weight.scale = 0.5`) are state a trace may read."""
        if isinstance(t, FakeTensor):
            return
        fields = getattr(t, "__dict__", None)
        if type(fields) is dict:  # (compared at the end: `self.w.n = ..` in forward is a store no watch sees)
            self.tensor_fields.append((t, source, dict(fields)))
        if fields and any(not k.startswith("_") for k in fields):
            attrs = Attr(source, "__dict__")
            self.guard(attrs, Kind.KEYS, tuple(fields), where)
            for k, v in list(fields.items()):
                if not k.startswith("_"):
                    self.adopt(v, Item(attrs, k), where=where)

    def _adopt_container(self, value: list | tuple | dict, source: Source, where: str) -> None:
        """A list, tuple or dict holding more than constants: guard its shape and each item by its own
        source (so a cache object inside is watched), and check at the end that the trace did not mutate it."""
        self.guard(source, Kind.TYPE, (type(value),), where)
        self.guard(source, Kind.LEN, len(value), where)
        if not self._name(value, source, where):
            return
        if type(value) not in (list, tuple, dict):
            self._guard_protocol(value, source, where)
            if isinstance(value, collections.defaultdict):  # (a C field: what reading a missing key stores)
                self.adopt(value.default_factory, Attr(source, "default_factory"), where=where)
        if len(value) > config.guard_max_items:
            self.guard(source, Kind.ID, value, where)
            self.mark_ineligible(f"reads {source.name()}, a {type(value).__name__} of {len(value)} items")
            return
        if isinstance(value, dict):
            user = user_hashed_key(value)
            if user is not None:
                self.guard(source, Kind.ID, value, where)
                self.mark_ineligible(f"reads {source.name()}, a dict keyed by {type(user).__qualname__} objects (their "
                                     "__hash__/__eq__ is Python a guard would run)")
                return
            self.guard(source, Kind.KEYS, tuple(value), where)
            self._objects.extend((key, Absolute(key, f"a key of {source.name()}")) for key in value if _by_identity(key))
        for key, item in (dict.items(value) if isinstance(value, dict) else enumerate(value)):  # (as stored: a
            # subclass's `__getitem__` is its Python, which may make a new value per read: transformers' ACT2FN)
            self.adopt(item, Item(source, key), where=where)
        if not isinstance(value, tuple):
            self._note_container(value, source, where)
        self.adopt_subclass_state(value, source, where)

    def adopt_subclass_state(self, value: list | tuple | dict, source: Source, where: str = "") -> None:
        """What a container subclass holds besides its items: its own attributes (`pair.tag`, set on the instance,
        read like any attribute) and its class's (a `__missing__` returning `self.default` or a class default,
        run by C code with no read stampout could see). A user class's instance passed as an argument, opened into
        its items (`Input`: no guard reads it), makes the trace ineligible when it has attributes of its own."""
        if type(value) in (list, tuple, dict):
            return
        fields = getattr(value, "__dict__", None)
        cls = original_class(value)
        if isinstance(source, Input) and type(fields) is dict and fields and is_user_class_object(cls):
            self.mark_ineligible(f"takes {source.name()}, a {cls.__qualname__} (a container of the user's) with "
                                 f"attributes of its own ({', '.join(list(fields)[:3])}) that no guard can read")
        elif type(fields) is dict and fields:
            attrs = Attr(source, "__dict__")
            self.guard(attrs, Kind.KEYS, tuple(fields), where)
            for key, item in list(fields.items()):
                self.adopt(item, Item(attrs, key), where=where)
        if is_user_class_object(cls):
            self._adopt_class(cls, where)

    def _guard_protocol(self, value: Any, source: Source, where: str) -> None:
        """A container of a subclass (of list, dict, nn.ModuleList, ...) is iterated, counted, indexed and tested for
        membership through type slots, with no attribute read to guard, as its class says: which may change between
        calls (`Layers.__iter__ = ...` on a class that had none of its own). Those methods are guarded by identity
        through the MRO; the guards on its items and length stand for them."""
        for name in _CONTAINER_PROTOCOL:
            self.guard(ClassAttr(TypeOf(source), name), Kind.ID, mro_attr(type(value), name), where)

    def _adopt_children(self, container: torch.nn.Module, source: Source, where: str) -> None:
        self.guard(source, Kind.LEN, len(container), where)
        if original_class(container) not in CONTAINERS:
            self._guard_protocol(container, source, where)
        for registry in ("_modules", "_parameters", "_keys"):  # (their order is the order `items()` walks)
            names = container.__dict__.get(registry)
            if type(names) is dict and names:
                self.guard(Attr(source, registry), Kind.KEYS, tuple(names), where)
        children = container.__dict__.get("_parameters") or {}
        children = {**children, **container.__dict__.get("_modules", {})}
        for key, child in children.items():
            if child is not None:
                self.adopt(child, Attr(source, key), where=where)

    def on_read(self, obj: Any, name: str, value: Any) -> None:
        base = self.sources.get(id(obj))
        if base is None:
            if obj in self.watch and id(obj) not in self.watch.arguments:
                self.mark_ineligible(
                    f"reads .{name} of a {type(obj).__name__} not reachable from its arguments, closures or globals"
                )
            return  # made during this capture (`type(self)(...)` of a watched object, a ModuleList slice)
        if (id(obj), name) in self._written:
            if not is_constant(value) and self._name(value, Attr(base, name)):  # (an int's identity means nothing)
                self.made.add(id(value))  # the trace's own value, not one from outside
            return
        where = user_location(3)
        if served_by_getattr(obj, name):  # (guarded as the trace of its __getattr__ read it, not by running it)
            if instance_fields(obj) is not None:
                self.guard(Item(Attr(base, "__dict__"), name), Kind.NO_OVERRIDE, MISSING, where)
            self.guard(ClassAttr(TypeOf(base), name), Kind.ABSENT, MISSING, where)
            self._adopt_class(original_class(obj), where)  # (its __getattr__ among the class's methods)
            return
        if value is MISSING:
            self.guard(Attr(base, name), Kind.ABSENT, MISSING, where)
            return
        on_class, raw = found_on_class(obj, name)
        if not on_class:
            self.adopt(value, Attr(base, name), where=where)
            fields = getattr(obj, "__dict__", None)
            if type(fields) is dict and fields.get(name, MISSING) is value:
                self.instance_reads.append((fields, name, value, base, id(obj)))
        elif isinstance(obj, torch.nn.Module) and name in _TREE_WALKS:
            self._guard_tree(obj, base, name, where)
        elif name == "forward" or is_user_class(obj, name):
            # A class attribute (method, property, default): the class's entry, and no instance override.
            self.guard(Item(Attr(base, "__dict__"), name), Kind.NO_OVERRIDE, MISSING, where)
            entry = ClassAttr(TypeOf(base), name)
            self.adopt(raw, entry, where=where)
        else:  # a library class's (`self._call_impl`, as nn.Module.__call__ reads it): what its MRO finds
            self._guard_class_names(original_class(obj), (name,))

    def _guard_tree(self, module: torch.nn.Module, source: Source, walk: str, where: str) -> None:
        """The program walks a module's registries (`self.children()`, `self.named_parameters()`): the names in
        each registry the walk visits are guarded (a child added with `add_module` between calls is walked too)."""
        registries = ("_modules", *_TREE_WALKS[walk])
        tree = module.named_modules() if not walk.endswith("children") else [("", module)]
        for path, m in tree:
            at = source
            for part in path.split(".") if path else ():
                at = Attr(at, part)
            for registry in registries:
                names = m.__dict__.get(registry)
                if type(names) is dict:
                    self.guard(Attr(at, registry), Kind.KEYS, tuple(names), where)

    def leaves_contain(self, value: Any) -> bool:
        return any(leaf is value for leaf in self.leaves)

    def mark_ineligible(self, reason: str, where: str = "", only_while: Guard | None = None) -> None:
        if all(record.reason != reason for record in self.ineligible):
            self.ineligible.append(Ineligible(reason, where or user_location(), only_while))
        if self.abandon:  # (a compiled program that cannot be guarded runs eagerly: stop its capture here,
            raise ProgramIneligible(reason, only_while)  # before the call it is about to make draws or consumes)

    def close(self) -> None:
        """At the end of the trace: a container it read and changed is a side effect too, and so is an
        input whose shape, strides or requires_grad changed in place (a stamped call would not change them)."""
        self._close_slots()
        self.close_imports()
        self._close_tensor_fields()
        for i, meta in self._input_meta:
            # (compared as keys made now: a symbolic size may have been specialized meanwhile)
            if meta_key(raw_meta(self.leaves[i])) != meta_key(meta):
                self.mark_ineligible(f"changes the metadata of its input {i} in place (resize_, transpose_, ...)")
        self._close_hooks()
        self._close_instance_reads()
        self._close_held_tensor_fields()
        change = self.namespaces.first_change(self._under_patch) if self.namespaces else None
        if change is not None:  # (`setattr(cfg_module, "N", ..)`, `vars(cfg_module).update(..)`: no bytecode shows it)
            self.mark_ineligible(f"changes {change} in a namespace it reads (a Python side effect stampout does not "
                                 "replay)")
        self._close_containers()
        self._close_identities()

    def _close_identities(self) -> None:
        """Which of the objects it read are one object, beyond the paths guarded SAME: `self is SPECIAL[0]`,
        `self in table` or `table.get(self)` test identity in C code no watch sees, and a reused trace (`self` now
        `layers[1]`) or a compiled one (`SPECIAL[0] = model.lin` between calls) must not take the other branch. A
        dict's keys are pinned by its KEYS guard (a weak key counts as its referent)."""
        by_class: dict[type, dict[int, Source]] = {}
        for obj, source in self._objects:
            target = obj() if type(obj) is weakref.ref else obj
            if target is None:
                continue
            seen = by_class.setdefault(type(target), {})
            first = seen.setdefault(id(target), source)
            if first is not source and isinstance(source, Absolute):  # (a key that is an object it read)
                self.guard(first, Kind.SAME, Absolute(target, source.label), "identities of the objects it read")
        for seen in by_class.values():
            if len(seen) > 1 and not all(isinstance(s, Absolute) for s in seen.values()):
                first, *rest = seen.values()
                self.guard(first, Kind.DISTINCT, tuple(rest), "identities of the objects it read")
        # A compiled program's input tensors and the plain tensors it read in state (not parameters or buffers: a
        # graph's own inputs have their memory compared per call): `self._last[0] is x` holds for one of eager's calls.
        buffers = {id(b) for m, _ in self._objects if isinstance(m, torch.nn.Module) for b in m._buffers.values()}
        held = {id(t): s for t, s in self._held_tensors if id(t) not in buffers}
        inputs = {id(t): Arg(i, label) for i, (t, label) in enumerate(zip(self.leaves, self.labels))
                  if isinstance(t, torch.Tensor) and id(t) not in held}
        if held and inputs:
            first, *rest = [*inputs.values(), *held.values()]
            self.guard(first, Kind.DISTINCT, tuple(rest), "identities of its input tensors and those it read")
