"""What one region trace changed outside itself: attribute stores, containers changed in place, attributes set
on its input tensors, globals its code assigns. A compiled program's frame keeps them to replay; a region trace
that makes one it cannot replay is ineligible (see RegionFrame); `undo` puts them back.
"""

from __future__ import annotations

import functools
import operator
import types
from collections.abc import Callable
from typing import Any

import torch

from .. import config
from ..guards.guard import Kind, is_constant
from ..guards.hook_keys import HOOK_DICTS, hooks_key
from ..sources import MISSING, Arg, Attr, Item, Source
from ..torch_internals import FakeTensor
from ..trace.code import is_user_code, user_hashed_key
from ..trace.frames import user_location
from ..watch.classpatch import peek
from ..watch.tracking import Watch
from .objects import contents, copy_value, fake_fields, program_fields


class FrameWrites:
    """The writes part of a RegionFrame: its attributes are set in `_begin_writes`."""

    # the host's (RegionFrame), read here
    program: bool
    labels: list[str]
    sources: dict[int, Source]
    watch: Watch
    guard: Callable[..., None]
    adopt: Callable[..., None]
    mark_ineligible: Callable[..., None]
    _defer: Callable[..., None]

    def _begin_writes(self, leaves: list[Any]) -> None:
        self.writes: list[str] = []  # Python side effects on objects from outside: "target at file:line"
        self.stores: list[tuple[Any, str, Any, Any, str]] = []  # (object, attribute, value, value before,
        # file:line) of each write, in order
        self._written: set[tuple[int, str]] = set()  # attributes this trace wrote: later reads read its value
        self.made: set[int] = set()  # objects first seen as the value of such an attribute (made during the call)
        self.containers: list[tuple[Any, Source, tuple]] = []
        self.global_stores: list[tuple[dict, str]] = []  # (globals, name) the code that ran may assign
        self.instance_reads: list[tuple[dict, str, Any, Source, int]] = []  # (an object's __dict__, name, value
        # read, the object's source and id): a write no watch saw (`object.__setattr__(self, ..)`) is found at the end
        self.tensor_fields: list[tuple[Any, Source, dict]] = []  # (a real tensor read, its source, its __dict__
        # then): a Python attribute the trace sets on a parameter or buffer is found at the end
        self.hooked: list[tuple[Any, tuple, Source, tuple]] = []  # (module, its hooks when read, source, copies
        # of its hook dicts then): hook dicts are no watched state, so they are compared at the end
        self.tree_hooks = [(m, hooks_key(m), _hook_copies(m)) for leaf in leaves if isinstance(leaf, torch.nn.Module)
                           for m in leaf.modules()] if config.watch_installed else []  # (the same, for every
        # module under an argument: a hook registered on one reached by a walk, `named_children()`, as transformers'
        # output capture installs them; put back only where the installing package is watched: its own record of
        # having installed them is then put back too, else the eager run finds them gone and not reinstalled)
        # Python attributes of the input tensors (`x.scale = 2.0` in forward): compared at the end
        self._input_fields = [(i, t, dict(t.__dict__)) for i, t in enumerate(leaves) if type(t) is FakeTensor]

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
            for name in program_fields({**before, **after}):
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
        """Lists and dicts among the call's arguments (opened into leaves), and sets (leaves the program gets
        as they are), at `source`: what the program changes in them is a side effect (undone after the capture,
        replayed by compiled calls into each call's own containers)."""
        if isinstance(value, dict) and user_hashed_key(value) is not None:  # (copying it would call them)
            self.mark_ineligible(f"takes {source.name()}, a dict keyed by objects whose __hash__/__eq__ is Python")
        elif type(value) in (list, dict, set) or isinstance(value, dict):  # (an OrderedDict, a defaultdict too)
            self._note_container(value, source, "")
            self.adopt_subclass_state(value, source)
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                self.note_input_containers(item, Item(source, i))
        elif isinstance(value, dict):
            for k, item in dict.items(value):
                self.note_input_containers(item, Item(source, k))

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

    def note_hooks(self, module: Any, hooks: tuple, source: Source) -> None:
        """A module the trace reads, with its hooks then (`hooks`, as guarded)."""
        self.hooked.append((module, hooks, source, _hook_copies(module)))
        for name in HOOK_DICTS:  # (the hooks by identity, in `hooks`: their code, defaults and cells when they run)
            held = module.__dict__.get(name)
            for key, hook in list(dict.items(held)) if isinstance(held, dict) else ():
                if type(hook) is types.FunctionType:
                    self._defer(hook, Item(Attr(source, name), key))
                elif _user_hook(hook):  # (a bound method, a partial, a callable object of the user's: what it
                    # reads and writes is watched: `scaler.calls += 1`, `out * scaler.scale`)
                    self.adopt(hook, Item(Attr(source, name), key), where=f"a hook of {source.name()}")

    def _close_hooks(self) -> None:
        """A hook registered or removed on a module the trace read (`self.lin.register_forward_hook(..)` in
        forward): a Python side effect no stamped or compiled call repeats."""
        for module, hooks, source, _ in self.hooked:
            if hooks_key(module) != hooks:
                self.mark_ineligible(f"registers or removes a hook of {source.name()} (a Python side effect a "
                                     "stamped or compiled call would not repeat)")
        for module, hooks, _ in self.tree_hooks:
            if hooks_key(module) != hooks:
                self.mark_ineligible(f"registers or removes a hook of a {type(module).__name__} under its arguments "
                                     "(a Python side effect a stamped or compiled call would not repeat)")
                return

    def _close_instance_reads(self) -> None:
        """An attribute read from an object's `__dict__` and changed behind its `__setattr__` during the trace
        (`object.__setattr__(self, "n", ..)`): a store no stamped or compiled call repeats."""
        for fields, name, value, base, owner in self.instance_reads:
            if fields.get(name, MISSING) is not value and (owner, name) not in self._written:
                self.mark_ineligible(f"changes {base.name()}.{name} behind its __setattr__ (object.__setattr__, "
                                     "__dict__): a Python side effect stampout does not replay")
                return

    def _close_held_tensor_fields(self) -> None:
        """A Python attribute set on (or deleted from) a real tensor the trace read (`self.weight.n = ..`)."""
        for t, source, before in self.tensor_fields:
            after = t.__dict__
            changed = [k for k in {**before, **after} if not k.startswith("_")
                       and before.get(k, MISSING) is not after.get(k, MISSING)]
            if changed:
                self.mark_ineligible(f"sets .{changed[0]} on {source.name()}, a tensor it reads (a Python side "
                                     "effect stampout does not replay)")
                return

    def _close_containers(self) -> None:
        for value, source, before, _ in self.containers:
            if contents(value) != before:
                self.writes.append(f"{source.name()} (changed in place)")
                if not self.program:
                    self.mark_ineligible(f"changes {source.name()} in place (a Python side effect)")


def put_back(container: Any, before: Any) -> None:
    """A dict, list or set as it was (`before`: a copy of its items); a dict untouched is left alone (compared by
    identity: values may be tensors, whose == compares elements), and so is a set with its members (refilled, its
    table would shrink and iterate in another order than eager's: `for cls in REGISTRY` takes the first match)."""
    if isinstance(container, dict):
        if list(container) != list(before) or any(dict.get(container, k) is not v for k, v in before.items()):
            container.clear()
            container.update(before)
    elif isinstance(container, list):
        container[:] = before
    elif isinstance(container, set) and (len(container) != len(before) or any(map(operator.is_not, container, before))):
        container.clear()
        container.update(before)


def undo(program: Any) -> None:
    """Put back what the capture's Python changed on objects that outlive it (newest first), and the state
    of opaque objects that can say theirs (a `random.Random` the program drew from)."""
    for obj, state in reversed(program.states):
        obj.setstate(state)
    for container, _, _, before in reversed(program.containers):
        put_back(container, before)
    if program.namespaces:
        program.namespaces.put_back()
    for fields, name, value, _, owner in reversed(program.instance_reads):  # (writes no watch saw)
        if fields.get(name, MISSING) is not value and (owner, name) not in program._written:
            fields[name] = value
    for t, _, before in reversed(program.tensor_fields):
        fields = t.__dict__
        for k in [k for k in {**before, **fields} if not k.startswith("_")]:
            if k in before:
                fields[k] = before[k]
            else:
                del fields[k]
    for module, _, saved in [*((m, None, c) for m, _, _, c in reversed(program.hooked)), *program.tree_hooks]:
        for name, before in zip(HOOK_DICTS, saved):
            hooks = module.__dict__.get(name)
            if hooks is not None:
                put_back(hooks, before or {})
    for obj, name, _, old, _ in reversed(program.stores):
        if old is not MISSING:
            setattr(obj, name, old)
        elif peek(obj, name) is not MISSING:
            delattr(obj, name)


def _user_hook(hook: Any) -> bool:
    """Whether a hook that is not a plain function runs the user's code (not torch's: FSDP's, parametrizations')."""
    fn = hook.__func__ if isinstance(hook, types.MethodType) else \
        hook.func if isinstance(hook, functools.partial) else getattr(type(hook), "__call__", None)
    code = getattr(fn, "__code__", None)
    return code is not None and is_user_code(code)


def _hook_copies(module: Any) -> tuple:
    """Copies of a module's hook dicts (None where empty)."""
    d = module.__dict__
    return tuple(dict(d[n]) if d.get(n) else None for n in HOOK_DICTS)
