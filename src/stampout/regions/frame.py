"""RegionFrame: what one region trace read, as guards on sources relative to the call's arguments.

Fail closed: every value the traced Python reads is guarded by value (constants), metadata (tensors),
identity (functions, classes) or by watching its reads (objects whose class can carry a shim); a value
that fits none of these makes the trace ineligible for reuse.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from .. import config
from ..classpatch import PATCHED_NAMES
from ..frames import user_location
from ..guards import Guard, Kind, const_key, hooks_key, is_constant, tensor_meta
from ..namespaces import TENSOR_DICT, NamespaceReads, patched_tensor_methods
from ..shapes import SIZES, size_key
from ..sources import MISSING, Absolute, Arg, Attr, ClassAttr, Closure, FnAttr, Global, Item, Source, TypeOf
from ..torch_internals import FakeTensor
from ..tracking import Watch, original_class
from .cache import ArgInput, LiftedInput
from .code import code_facts, is_user_file, is_user_module
from .events import Ineligible
from .objects import (
    BY_IDENTITY,
    CONTAINERS,
    accepted_types,
    by_name,
    contents,
    copy_value,
    fake_fields,
    found_on_class,
    hidden_state,
    is_user_class,
    is_user_class_object,
    meta_key,
    ours,
    raw_meta,
)
from .slots import SlotTracker


class ProgramIneligible(BaseException):  # noqa: N818 - control flow, not an error (user code must not catch it)
    """Raised out of the program a compile captures as soon as its frame is ineligible: the program will run
    eagerly, and the rest of the capture would only consume state (an iterator, an RNG) eager must see."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RegionFrame:
    """Reads recorded while one region call is traced, and why its trace may not be reusable."""

    def __init__(self, fn: Callable, leaves: list[Any], labels: list[str], watch: Watch,
                 program: bool = False) -> None:
        self.fn = fn
        self.program = program  # the whole program's frame (compile): its stores are replayed, not refused
        self.leaves = leaves
        self.labels = labels
        self.watch = watch
        self.sources: dict[int, Source] = {}
        self._keep: list[Any] = []
        self.guards: list[Guard] = []
        self._guarded: set[tuple[Source, Kind]] = set()
        # Per (entry, region function) imported once: the entry's guards on class, global and closure facts,
        # which rebase to the same guards on every stamped call; later calls import only the per-call ones.
        self._facts_imported: dict[tuple[int, int], tuple[Any, list[Guard]]] = {}
        self.ineligible: list[Ineligible] = []
        self.reads_requires_grad = False
        self.writes: list[str] = []  # Python side effects on objects from outside: "target at file:line"
        self.stores: list[tuple[Any, str, Any, Any, str]] = []  # (object, attribute, value, value before,
        # file:line) of each write, in order
        self._functions: set[types.CodeType] = set()  # codes whose globals (and cells, if known) are guarded
        self._local_codes: set[types.CodeType] = set()  # functions defined while tracing (closures over locals)
        self._guarded_code: set[tuple[types.CodeType, int]] = set()
        self._classes: set[type] = set()
        self.states: list[tuple[Any, Any]] = []  # (object, getstate()) of opaque objects the trace read
        self._adopted: dict[int, Callable] = {}  # functions whose cells and defaults are guarded
        self._written: set[tuple[int, str]] = set()  # attributes this trace wrote: later reads read its value
        self.made: set[int] = set()  # objects first seen as the value of such an attribute (made during the call)
        self.containers: list[tuple[Any, Source, tuple]] = []
        self.global_stores: list[tuple[dict, str]] = []  # (globals, name) the code that ran may assign
        self.lifted: list[LiftedInput] = []
        self.slots: SlotTracker | None = None  # int attributes this region trace follows (created on first read)
        self.cache_misses: dict[int, int] = {}  # functools caches known when the trace began: misses then
        self.world_state: dict[int, tuple] = {}  # what the memo containers and module globals held then
        self.abandon = False  # raise ProgramIneligible when made ineligible (a compiled program's frame)
        for i, leaf in enumerate(leaves):
            if not is_constant(leaf):
                if not isinstance(leaf, torch.Tensor):
                    watch.arguments.add(id(leaf))
                self.adopt(leaf, Arg(i, labels[i]), from_arg=True)
        self._input_meta = [(i, raw_meta(t)) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        # Python attributes of the input tensors (`x.scale = 2.0` in forward): compared at the end
        self._input_fields = [(i, t, dict(t.__dict__)) for i, t in enumerate(leaves) if type(t) is FakeTensor]
        self.namespaces = NamespaceReads()  # module attributes and Tensor methods, by identity
        self.namespaces.note_whole(TENSOR_DICT, "torch.Tensor")
        self.guard(Absolute(self.namespaces, "names read in modules"), Kind.NAMESPACE, None, "module attributes")
        for name in patched_tensor_methods():
            self.mark_ineligible(f"runs with torch.Tensor.{name} replaced by a Python function (stampout traces "
                                 "torch's own methods only)")
        self.adopt_function(fn, None)

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
        elif isinstance(value, types.FunctionType):
            self._adopt_callable(value, source, where)
        elif isinstance(value, types.MethodType):
            self.adopt(value.__func__, Attr(source, "__func__"), where=where)
            self.adopt(value.__self__, Attr(source, "__self__"), where=where)
        elif type(value) is functools.partial:
            self.guard(source, Kind.TYPE, (functools.partial,), where)
            for part in ("func", "args", "keywords"):
                self.adopt(getattr(value, part), Attr(source, part), where=where)
        elif isinstance(value, BY_IDENTITY):
            self.guard(source, Kind.ID, value, where)
            if isinstance(value, types.ModuleType):  # (reached as a value: any of its attributes may be read)
                self._note_user_namespace(value)
        elif isinstance(value, (list, tuple, dict)):
            self._adopt_container(value, source, where)
        elif not hidden_state(type(value)) and self.watch.watch(value):
            if not from_arg:
                self.guard(source, Kind.TYPE, accepted_types(value), where)
            if self._name(value, source, where):
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
        self.guard(source, Kind.HOOKS, hooks_key(value), where)
        if not self._name(value, source, where):
            return
        self.watch.watch(value)
        self._adopt_class(original_class(value), where)
        if isinstance(value, CONTAINERS):
            self._adopt_children(value, source, where)

    def _adopt_class(self, cls: type, where: str) -> None:
        """What a user class defines (defaults, methods, classmethods' data): a class attribute changed
        between calls, or a method swapped on the class, changes what its instances compute."""
        for klass in cls.__mro__:
            if klass in self._classes or not is_user_class_object(klass):
                continue
            self._classes.add(klass)
            namespace = Attr(Absolute(klass, klass.__qualname__), "__dict__")
            for name, value in list(klass.__dict__.items()):
                if not (name.startswith("__") and name.endswith("__")) and name not in PATCHED_NAMES:
                    self.adopt(value, Item(namespace, name), where=where)

    def _adopt_tensor_attributes(self, t: torch.Tensor, source: Source, where: str) -> None:
        """Python attributes set on a tensor (`weight.scale = 0.5`) are state a trace may read."""
        if isinstance(t, FakeTensor):
            return
        fields = getattr(t, "__dict__", None)
        if fields and any(not k.startswith("_") for k in fields):
            attrs = Attr(source, "__dict__")
            self.guard(attrs, Kind.KEYS, tuple(fields), where)
            for k, v in list(fields.items()):
                if not k.startswith("_"):
                    self.adopt(v, Item(attrs, k), where=where)

    def note_tensor_fields(self, index: int, keys: tuple, fields: dict, where: str = "") -> None:
        """The call's input `index` is a tensor carrying Python attributes (`fields`, copied onto its fake; `keys`
        all its `__dict__`'s): guarded."""
        attrs = Attr(Arg(index, self.labels[index]), "__dict__")
        self.guard(attrs, Kind.KEYS, keys, where)
        for k, v in fields.items():
            self.adopt(v, Item(attrs, k), where=where)

    def _close_tensor_fields(self) -> None:
        """Attributes the traced Python set on (or deleted from) an input tensor: a store the program's
        compiled calls replay on their own inputs; a region trace that does it cannot be stamped."""
        internal = fake_fields()
        for i, t, before in self._input_fields:
            after = t.__dict__
            for name in [k for k in {**before, **after} if k not in internal and not k.startswith("_")]:
                old, new = before.get(name, MISSING), after.get(name, MISSING)
                if old is new:
                    continue
                target = f"{self.labels[i]}.{name}"
                self.writes.append(f"{target} (set on an input tensor)")
                if self.program:  # replayed on each call's input, which must have the attributes this one had
                    self.guard(Attr(Arg(i, self.labels[i]), "__dict__"), Kind.KEYS,
                               tuple(k for k in before if k not in internal), f"{target} is set by the program")
                    self.stores.append((t, name, new, old, target))
                else:
                    self.mark_ineligible(f"sets {target}, an attribute of its input tensor (a Python side effect)")

    def _adopt_callable(self, fn: types.FunctionType, source: Source, where: str) -> None:
        """A Python function: a region wrapper by its innermost function, others by identity, and in both
        cases the closure cells and defaults its code reads."""
        marked = getattr(fn, "__stampout_region__", None)
        if marked is not None:  # one wrapper per marked instance, all with the same code and function
            self.guard(Attr(source, "__code__"), Kind.ID, fn.__code__, where)
            self._adopt_callable(marked.fn, Attr(Attr(source, "__stampout_region__"), "fn"), where)
            return
        self.guard(source, Kind.ID, fn, where)
        if is_user_file(fn.__code__.co_filename):
            self.adopt_function(fn, source)

    def _adopt_container(self, value: list | tuple | dict, source: Source, where: str) -> None:
        """A list, tuple or dict holding more than constants: guard its shape and each item by its own
        source (so a cache object inside is watched), and check at the end that the trace did not mutate it."""
        self.guard(source, Kind.TYPE, (type(value),), where)
        self.guard(source, Kind.LEN, len(value), where)
        if not self._name(value, source, where):
            return
        if len(value) > config.guard_max_items:
            self.guard(source, Kind.ID, value, where)
            self.mark_ineligible(f"reads {source.name()}, a {type(value).__name__} of {len(value)} items")
            return
        if isinstance(value, dict):
            self.guard(source, Kind.KEYS, tuple(value), where)
        for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            self.adopt(item, Item(source, key), where=where)
        if not isinstance(value, tuple):
            self._note_container(value, source, where)

    def _note_container(self, value: Any, source: Source, where: str) -> None:
        """Watch a mutable container for changes, once: a second path to the same list (a closure cell and a class
        attribute) is guarded to lead to it, and its changes are planned at the first."""
        for known, first, *_ in self.containers:
            if known is value:
                if first != source:
                    self.guard(source, Kind.SAME, first, where)
                return
        self.containers.append((value, source, contents(value), copy_value(value)))
        if is_constant(value) and type(value) in (list, dict):  # (a dict of lists: the trace may change an inner
            # one through a subscript)
            for key, item in list(value.items() if isinstance(value, dict) else enumerate(value)):
                if type(item) in (list, dict, set):
                    self._note_container(item, Item(source, key), where)

    def note_changed_container(self, value: dict, source: Source, before: dict) -> None:
        """A container changed by the program behind the watch (a module's `_buffers` by `register_buffer`), with
        its items `before`: planned and undone as the containers noted when read."""
        self.containers.append((value, source, contents(before), before))

    def note_input_containers(self, value: Any, source: Source) -> None:
        """Lists and dicts among the call's arguments (opened into leaves), at `source`: what the program
        changes in them is a side effect (replayed by compiled calls into each call's own containers)."""
        if type(value) in (list, dict):
            self._note_container(value, source, "")
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                self.note_input_containers(item, Item(source, i))
        elif isinstance(value, dict):
            for k, item in value.items():
                self.note_input_containers(item, Item(source, k))

    # ---- per-layer indices -------------------------------------------------------------------------
    def slot_read(self, obj: Any, name: str, value: int, user: types.FrameType) -> Any:
        """`obj.name` is an int this trace may follow as a per-layer index: a SlotIndex, or None (read it as a
        constant)."""
        base = self.sources.get(id(obj))
        if base is None or (id(obj), name) in self._written or self.program:
            return None
        d = getattr(obj, "__dict__", None)
        if not isinstance(d, dict) or d.get(name, MISSING) is not value:
            return None
        if self.slots is None:
            self.slots = SlotTracker(self)
        return self.slots.read(Attr(base, name), value, name, user)

    def container_read(self, obj: Any, name: str, value: Any, user: types.FrameType) -> None:
        """A list or tuple attribute read: followed in case a per-layer index picks an item of it."""
        if self.program or self.sources.get(id(obj)) is None:
            return
        if self.slots is None:
            self.slots = SlotTracker(self)
        self.slots.container_read(value, user)

    def rename(self, obj: Any, source: Source) -> None:
        """`obj` was reached as an item chosen by a per-layer index: what the trace reads through it is
        read at `source` on each call (its class guarded there)."""
        self.sources[id(obj)] = source
        self._keep.append(obj)
        self.guard(source, Kind.TYPE, accepted_types(obj), user_location(4))
        if isinstance(obj, torch.nn.Module):
            self.guard(source, Kind.HOOKS, hooks_key(obj), user_location(4))

    def _close_slots(self) -> None:
        if self.slots is None:
            return
        for state in self.slots.close():
            where = f"{state.source.name()} (used by {state.why})" if state.used else ""
            if state.used:
                self.guard(state.source, Kind.CONST, const_key(state.value), where)
            else:
                self.guard(state.source, Kind.TYPE, (int,), where)

    def close(self) -> None:
        """At the end of the trace: a container it read and changed is a side effect too, and so is an
        input whose shape, strides or requires_grad changed in place (a stamped call would not change them)."""
        self._close_slots()
        self._close_tensor_fields()
        for i, meta in self._input_meta:
            # (compared as keys made now: a symbolic size may have been specialized meanwhile)
            if meta_key(raw_meta(self.leaves[i])) != meta_key(meta):
                self.mark_ineligible(f"changes the metadata of its input {i} in place (resize_, transpose_, ...)")
        for value, source, before, _ in self.containers:
            if contents(value) != before:
                self.writes.append(f"{source.name()} (changed in place)")
                if not self.program:
                    self.mark_ineligible(f"changes {source.name()} in place (a Python side effect)")

    def _adopt_children(self, container: torch.nn.Module, source: Source, where: str) -> None:
        self.guard(source, Kind.LEN, len(container), where)
        children = container.__dict__.get("_parameters") or {}
        children = {**children, **container.__dict__.get("_modules", {})}
        for key, child in children.items():
            if child is not None:
                self.adopt(child, Attr(source, key), where=where)

    def adopt_function(self, fn: Callable, as_source: Source | None) -> None:
        """Guard the defaults and closure cells of a function whose code may run (`as_source=None`: the
        region's own function, whose cells and defaults are resolved from each call's function)."""
        code = getattr(fn, "__code__", None)
        if code is None or id(fn) in self._adopted:
            return  # (functions with one code and other cells, like closures made per layer, each count)
        self._adopted[id(fn)] = fn
        self._functions.add(code)
        where = f"defaults of {code.co_qualname}"
        for attr in ("__defaults__", "__kwdefaults__"):  # a default the call did not pass is read too
            default = getattr(fn, attr, None)
            if default is not None:
                source = FnAttr(attr) if as_source is None else Attr(as_source, attr)
                self.adopt(default, source, where=where)
        closure = getattr(fn, "__closure__", None) or ()
        for i, var in enumerate(code.co_freevars):
            try:
                value = closure[i].cell_contents
            except (IndexError, ValueError):
                continue
            cell = (Closure(i, var) if as_source is None
                    else Attr(Item(Attr(as_source, "__closure__"), i), "cell_contents"))
            self.adopt(value, cell, where=f"closure of {code.co_qualname}")
        if as_source is None:
            self.on_code(code, fn.__globals__, own=True)

    def on_code(self, code: types.CodeType, g: dict, own: bool = False, where: str = "") -> None:
        """Python code is about to run in this trace: guard the globals it may read (and `module.attr`
        chains), record the globals it assigns, and refuse closures this frame cannot reach."""
        key = (code, id(g))
        if key in self._guarded_code:
            return
        self._guarded_code.add(key)
        facts = code_facts(code)
        self._local_codes.update(facts.nested)
        free = [v for v in code.co_freevars if v != "__class__"]
        if free and code not in self._functions and code not in self._local_codes:
            self.mark_ineligible(
                f"runs {code.co_qualname}, a closure over {', '.join(free)} that stampout cannot reach"
            )
        label = f"{g.get('__name__', '?')}.globals"
        own = own or (g is getattr(self.fn, "__globals__", None))
        where = where or f"global of {code.co_qualname}"
        for name in facts.names:
            if name in g:
                value = g[name]
                source = Global(name) if own else Item(Absolute(g, label), name)
                if isinstance(value, types.ModuleType):
                    self._adopt_module_chains(value, source, name, facts.chains, where)
                    if name in facts.escapes:
                        self._note_user_namespace(value)
                else:
                    self.adopt(value, source, where=where)
        for chain in facts.attribute_stores:  # neither a stamped nor a compiled call would store it again
            if isinstance(g.get(chain[0]), types.ModuleType):
                self.mark_ineligible(f"stores {'.'.join(chain)} in a module's namespace (at {code.co_qualname}), "
                                     "a Python side effect stampout does not replay")
        for name in facts.stores:
            self.global_stores.append((g, name))
            self.writes.append(f"global {name} (assigned by {code.co_qualname})")
            self.mark_ineligible(f"assigns the global {name} (a Python side effect stampout does not replay)")

    def on_library_code(self, code: types.CodeType, g: dict) -> None:
        """torch.nn's module code is about to run (`nn.GELU.forward` calls `F.gelu`): the functions, classes and
        modules it reaches through its globals are guarded by identity, in the NamespaceReads."""
        key = (code, id(g))
        if key in self._guarded_code:
            return
        self._guarded_code.add(key)
        facts = code_facts(code)
        label = g.get("__name__", "?")
        for name in facts.names:
            value = g.get(name, MISSING)
            if value is MISSING or not by_name(value):
                continue
            self.namespaces.note(g, label, name, value)
            if isinstance(value, types.ModuleType):
                for chain in facts.chains:
                    if chain[0] == name:
                        self._note_chain(value, chain[1:])

    def _note_user_namespace(self, module: types.ModuleType) -> None:
        """A user's module used as a value (`getattr(cfg, name)`, `self.cfg_module.SCALE`): every name in it is
        guarded by identity (one dict-version check per call), since no bytecode chain says which are read."""
        if is_user_module(module):
            self.namespaces.note_whole(module.__dict__, module.__name__)

    def _note_chain(self, module: types.ModuleType, attrs: tuple[str, ...]) -> None:
        for attr in attrs:
            found = module.__dict__.get(attr, MISSING)
            if found is MISSING or not by_name(found):
                return
            self.namespaces.note(module.__dict__, module.__name__, attr, found)
            if not isinstance(found, types.ModuleType):
                return
            module = found

    def _adopt_module_chains(self, module: types.ModuleType, source: Source, name: str,
                             chains: tuple[tuple[str, ...], ...], where: str) -> None:
        """`F.gelu`, `torch.nn.functional.gelu`, `cfg.FLAG` through a module global: the module itself by
        identity, and each attribute reached. Modules, classes, builtins and library functions found in a
        module's `__dict__` are guarded by identity through one NamespaceReads (dict versions: a fixed cost per
        call however many names); other values (a config constant, a user function) by their own guards."""
        self.guard(source, Kind.ID, module, where)
        for chain in chains:
            if chain[0] != name:
                continue
            value: Any = module
            src = source
            for attr in chain[1:]:
                if not isinstance(value, types.ModuleType):
                    break
                namespace = value.__dict__
                found = getattr(value, attr, MISSING)
                src = Attr(src, attr)
                if ours(found):
                    break  # stampout's stand-in while capturing (`torch.compiler.is_compiling`)
                if attr in namespace and namespace[attr] is found and by_name(found):
                    self.namespaces.note(namespace, value.__name__, attr, found)
                else:
                    self.adopt(found, src, where=where)
                    break
                value = found

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
        if value is MISSING:
            self.guard(Attr(base, name), Kind.ABSENT, MISSING, where)
            return
        on_class, raw = found_on_class(obj, name)
        if not on_class:
            self.adopt(value, Attr(base, name), where=where)
        elif name == "forward" or is_user_class(obj, name):
            # A class attribute (method, property, default): the class's entry, and no instance override.
            self.guard(Item(Attr(base, "__dict__"), name), Kind.NO_OVERRIDE, MISSING, where)
            entry = ClassAttr(TypeOf(base), name)
            if isinstance(raw, property):
                self.guard(entry, Kind.ID, raw, where)
                for part, role in ((raw.fget, "fget"), (raw.fset, "fset")):
                    if isinstance(part, types.FunctionType) and is_user_file(part.__code__.co_filename):
                        self.adopt_function(part, Attr(entry, role))
            elif isinstance(raw, (staticmethod, classmethod)):
                self.guard(entry, Kind.ID, raw, where)
                self.adopt(raw.__func__, Attr(entry, "__func__"), where=where)
            else:
                self.adopt(raw, entry, where=where)

    def on_write(self, obj: Any, name: str, value: Any, old: Any) -> None:
        base = self.sources.get(id(obj))
        if base is None and (obj not in self.watch or id(obj) in self.watch.arguments):
            return  # an object made during this capture
        target = f"{base.name()}.{name}" if base is not None else f"a {type(obj).__name__}.{name}"
        where = user_location(3)
        self.writes.append(f"{target} at {where}")
        self.stores.append((obj, name, value, old, where))
        self._written.add((id(obj), name))
        if not self.program and base is None:
            self.mark_ineligible(f"writes {target} (a Python side effect) at {where}")
        # (stores on objects it can name are replayed by its stamped calls when their values allow it:
        # RegionCalls decides when the trace ends)

    def leaves_contain(self, value: Any) -> bool:
        return any(leaf is value for leaf in self.leaves)

    def mark_ineligible(self, reason: str, where: str = "") -> None:
        if all(record.reason != reason for record in self.ineligible):
            self.ineligible.append(Ineligible(reason, where or user_location()))
        if self.abandon:  # (a compiled program that cannot be guarded runs eagerly: stop its capture here,
            raise ProgramIneligible(reason)  # before the call it is about to make draws or consumes anything)

    # ---- a nested region call that was stamped out instead of traced -----------------------------
    def import_entry(self, entry: Any, leaves: list[Any], fn: Callable, lifted_values: list[Any]) -> None:
        """Take over the guards of a nested entry stamped out during this trace, rebased onto our sources."""
        unnamed: set[int] = set()

        def translate(root: Source) -> Source | None:
            if isinstance(root, Arg):
                source = self.sources.get(id(leaves[root.index]))
                if source is None:
                    unnamed.add(root.index)
                return source
            if isinstance(root, Closure):
                return Attr(Item(Attr(Absolute(fn, fn.__qualname__), "__closure__"), root.index), "cell_contents")
            if isinstance(root, Global):
                return Item(Absolute(fn.__globals__, f"{fn.__module__}.globals"), root.var)
            if isinstance(root, FnAttr):
                return Attr(Absolute(fn, fn.__qualname__), root.attr)
            return root

        key = (id(entry), id(fn))
        imported = self._facts_imported.get(key)
        if imported is None:
            guards = entry.guards
            self._facts_imported[key] = (fn, [g for g in entry.guards if _reads_arguments(g)])  # fn kept alive
        else:
            guards = imported[1]
        for guard in guards:
            source = guard.source.rebase(translate)
            expected = guard.expected.rebase(translate) if guard.kind is Kind.SAME else guard.expected
            if source is None or expected is None:
                # An argument this frame cannot name is an object the traced code made itself (its state
                # comes from what this frame read); anything else would be unguarded: refuse.
                if any(not _made_here(leaves[i], self.watch) for i in unnamed):
                    self.mark_ineligible(f"calls region {entry.region} with an argument it cannot name")
                    return
                continue
            self.guard(source, guard.kind, expected, guard.where)
        for spec, value in zip(entry.lifted, lifted_values):
            if not isinstance(spec, ArgInput) and isinstance(value, torch.Tensor):
                source = spec.source.rebase(translate) if spec.source is not None else None
                if source is not None:
                    self._name(value, source)


def _rooted_in_arguments(source: Source) -> bool:
    if any(_rooted_in_arguments(s) for s in source.operands()):
        return True
    parent = source.base()
    return isinstance(source, Arg) if parent is None else _rooted_in_arguments(parent)


def _reads_arguments(guard: Guard) -> bool:
    """Whether a guard's source (or, for SAME, the other side) starts from a call argument."""
    return _rooted_in_arguments(guard.source) or guard.kind is Kind.SAME and _rooted_in_arguments(guard.expected)


def _made_here(obj: Any, watch: Watch) -> bool:
    return isinstance(obj, torch.Tensor) or is_constant(obj) or obj not in watch or id(obj) in watch.arguments
