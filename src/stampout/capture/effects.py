"""Python side effects of a compiled program: planned at capture, undone after it, replayed after each call.

A capture runs the program's Python once, on fake tensors. What it stored on objects that outlive the call
(attribute writes, items appended to or set in lists and dicts) is recorded by the program's frame. After
the capture those stores are undone (no fake tensor is left on the caller's objects), and every compiled
call replays them with that call's values: constants as recorded, tensors from extra graph outputs,
existing objects from their sources. A store that cannot be replayed that way (an object the call made, a dict
keyed by a traced tensor) makes the program ineligible: `compile` runs it eagerly, with a warning.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass
from typing import Any

import torch

from ..guards.guard import is_constant
from ..regions.frame_writes import put_back
from ..regions.frame_writes import undo as undo  # (capture/program.py's)
from ..sources import MISSING, Arg, Attr, CallContext, Item, SlotItem, Source
from ..torch_internals import FakeTensor
from ..trace.shapes import any_symbolic
from ..trace.structure import holds_fake


class ValueKind(enum.Enum):
    """How a replayed value is obtained: the kind of a `Value`, what its `value` holds."""

    CONST = "const"  # the constant itself
    OUT = "out"  # the index of an extra graph output
    OUT_CONSTANT = "out_constant"  # the index of an extra graph output, taken without autograd
    SOURCE = "source"  # a source, resolved against the call
    SEQ = "seq"  # (a tuple or torch.Size class, its items' Values): a tuple the call made, sizes the graph computes
    NEW = "new"  # (list or dict, its items' Values, or (key, Value) pairs): a container the call made
    MISSING = "missing"  # nothing: the attribute or item is not there


@dataclass(frozen=True)
class Value:
    """How a replayed value is obtained: a constant, extra graph output `index`, or a source."""

    kind: ValueKind
    value: Any = None

    def get(self, ctx: CallContext, outputs: list[Any]) -> Any:
        if self.kind is ValueKind.CONST:
            return self.value
        if self.kind is ValueKind.OUT:
            return outputs[self.value]
        if self.kind is ValueKind.OUT_CONSTANT:  # (AOTAutograd hands back every output as requiring grad)
            out = outputs[self.value]
            return out.detach() if out.requires_grad else out
        if self.kind is ValueKind.SOURCE:
            return self.value.resolve(ctx, {})
        if self.kind is ValueKind.SEQ:  # a tuple or torch.Size holding sizes the graph computes
            cls, items = self.value
            return cls(item.get(ctx, outputs) for item in items)
        if self.kind is ValueKind.NEW:  # a list or dict the call made (`cache.setdefault("layer0", {})`): made anew
            cls, items = self.value
            if cls is dict:
                return {k: v.get(ctx, outputs) for k, v in items}
            return [v.get(ctx, outputs) for v in items]
        return MISSING


class EffectOp(enum.Enum):
    """What an `Effect` does to its target with its values."""

    SETATTR = "setattr"  # key: the attribute (its value MISSING: deleted)
    EXTEND = "extend"  # the values appended to a list
    ADD = "add"  # the values added to a set
    SETITEM = "setitem"  # key: the item of a list or dict
    REPLACE = "replace"  # a list's items, or a dict's (key holds its keys in order)


@dataclass(frozen=True)
class Effect:
    """One store to replay (see EffectOp)."""

    op: EffectOp
    target: Source
    key: Any
    values: tuple[Value, ...]
    where: str

    def values_of(self, ctx: CallContext, outputs: list[Any]) -> list[Any]:
        return [v.get(ctx, outputs) for v in self.values]

    def replay(self, ctx: CallContext, outputs: list[Any], values: list[Any] | None = None) -> None:
        """The store, with `values` read before (see Entry.replay), else read now."""
        target = self.target.resolve(ctx, {})
        values = self.values_of(ctx, outputs) if values is None else values
        if self.op is EffectOp.SETATTR:
            if values[0] is MISSING:
                if hasattr(target, self.key):
                    delattr(target, self.key)
            else:
                setattr(target, self.key, values[0])
        elif self.op is EffectOp.EXTEND:
            target.extend(values)
        elif self.op is EffectOp.ADD:  # members added to a set
            target.update(values)
        elif self.op is EffectOp.REPLACE:
            if isinstance(target, dict):
                target.clear()
                target.update(zip(self.key, values))
            else:
                target[:] = values
        else:
            target[self.key] = values[0]


class Plan:
    """The effects of one capture, and the fake tensors whose real values must become extra outputs."""

    def __init__(self, program: Any) -> None:
        self.program = program
        self.effects: list[Effect] = []
        self.extra: list[torch.Tensor] = []
        self._named: list[tuple[Source, Any, str]] = []  # (source, the object stored, file:line): see check_named
        self._making: set[int] = set()  # containers made by the call being planned (a cycle is refused)
        if program is not None:
            self._build()

    def _value(self, value: Any, where: str) -> Value | None:
        sources = self.program.sources
        if value is MISSING:
            return Value(ValueKind.MISSING)
        if is_constant(value) and type(value) not in (list, dict, set):
            return Value(ValueKind.CONST, value)
        if isinstance(sources.get(id(value)), Arg):  # one of the call's own inputs: that very object
            return Value(ValueKind.SOURCE, sources[id(value)])
        if isinstance(value, (FakeTensor, torch.SymInt, torch.SymFloat, torch.SymBool)):  # computed by the graph
            self.extra.append(value)
            constant = isinstance(value, FakeTensor) and not value.requires_grad
            return Value(ValueKind.OUT_CONSTANT if constant else ValueKind.OUT, len(self.extra) - 1)
        if type(value) is tuple or type(value) is torch.Size and any_symbolic(value):  # (an LSTM's `(h, c)` kept)
            items = [self._value(v, where) for v in value]
            return None if any(i is None for i in items) else Value(ValueKind.SEQ, (type(value), tuple(items)))
        if id(value) in sources and id(value) not in self.program.made:  # (not one the call made and stored)
            self._named.append((sources[id(value)], value, where))
            return Value(ValueKind.SOURCE, sources[id(value)])
        if type(value) in (list, dict) and id(value) not in self._making:  # made by the call
            if type(value) is dict and self._traced_keys(value, (), where):
                return None
            self._making.add(id(value))
            pairs = list(value.items()) if type(value) is dict else list(enumerate(value))
            items = [(k, self._value(v, where)) for k, v in pairs]
            self._making.discard(id(value))
            if all(v is not None for _, v in items):
                inside = tuple(items) if type(value) is dict else tuple(v for _, v in items)
                return Value(ValueKind.NEW, (type(value), inside))
            return None
        self._refuse(f"stores a {type(value).__name__} made during the call (at {where})")
        return None

    def _refuse(self, reason: str) -> None:
        """A store no compiled call can repeat: the program runs eagerly (compile), with `reason` in the warning."""
        self.program.mark_ineligible(reason)

    def check_named(self, ctx: CallContext) -> None:
        """After the capture's stores are undone (`ctx`: the captured call's): an object a store replays from its
        source must be the one that source names before the call, where each compiled call reads it. One the call
        made and reached again through a place it filled (`self.cache["act"] = nn.ReLU()`, then read back) is
        not: refused as any object made during the call."""
        memo: dict = {}
        for source, value, where in self._named:
            if source.resolve(ctx, memo) is not value:
                self._refuse(f"stores a {type(value).__name__} made during the call (at {where})")
                return

    def _traced_keys(self, d: dict, before: Any, where: str) -> bool:
        """Whether a key `d` gained holds a traced tensor (`memo[t] = ...`): no replayed store can make that key
        again per call (each call's tensor is a new key in eager), so the program is refused."""
        if any(holds_fake(k, whole=True) for k in list(dict.keys(d)) if k not in before):
            self._refuse(f"keys a dict by a traced tensor (at {where})")
            return True
        return False

    def _build(self) -> None:
        program = self.program
        last: dict[tuple[int, str], tuple[Any, str, Any, str]] = {}
        for obj, name, value, _, where in program.stores:
            if id(obj) in program.sources:
                last[(id(obj), name)] = (obj, name, value, where)
        for obj, name, value, where in last.values():
            v = self._value(value, where)
            if v is not None:
                self.effects.append(Effect(EffectOp.SETATTR, program.sources[id(obj)], name, (v,), where))
        planned: set[int] = set()
        for container, source, _, before in program.containers:
            if id(container) not in planned:  # one list reached by two paths: its first note saw it as it was
                planned.add(id(container))
                self._container(container, source, before)
        self._crossed()

    def _crossed(self) -> None:
        """A store whose target is reached through a place another store of the call changes is refused: targets
        are paths as the call found them (`h.layers[1]`), resolved when replayed, after `h.layers = [h.layers[1],
        h.layers[0]]` would name the other layer (eager wrote `h.layers[0].k` on the one the call moved there)."""
        attrs, items, whole = set(), set(), set()
        for e in self.effects:
            if e.op is EffectOp.SETATTR:
                attrs.add((e.target, e.key))
            elif e.op is EffectOp.SETITEM:
                items.add((e.target, e.key))
            else:
                whole.add(e.target)
        for e in self.effects:
            step = e.target
            while step is not None:
                parent = step.base()
                if (type(step) is Attr and (parent, step.attr) in attrs
                        or type(step) is Item and ((parent, step.item) in items or parent in whole)
                        or type(step) is SlotItem and parent in whole):
                    self._refuse(f"stores through {step.name()}, which another of its stores changes (at {e.where})")
                    return
                step = parent

    def _container(self, container: Any, source: Source, before: Any) -> None:
        where = f"{source.name()} (changed in place)"
        if isinstance(container, dict):
            if self._traced_keys(container, before, where):
                return
            # (its items as dict keeps them, in one order: a subclass's own __iter__ may list its keys in another,
            # and keys zipped with values of the other order would swap the caller's values)
            keys = list(dict.keys(container))
            if keys[:len(before)] != list(before):  # items removed (`del d[k]`, `pop`) or reordered
                values = [self._value(v, where) for v in dict.values(container)]
                if all(v is not None for v in values):
                    self.effects.append(Effect(EffectOp.REPLACE, source, tuple(keys), tuple(values), where))
                return
            for k, v in dict.items(container):
                if k not in before or before[k] is not v:
                    value = self._value(v, where)
                    if value is not None:
                        self.effects.append(Effect(EffectOp.SETITEM, source, k, (value,), where))
            return
        if isinstance(container, set):
            now = {id(v) for v in container}
            added = [v for v in container if not any(v is b for b in before)]
            if any(id(b) not in now for b in before):  # (a member removed: the call's own set may not hold it)
                self._refuse(f"removes members of {where}")
            elif added:
                values = [self._value(v, where) for v in added]
                if all(v is not None for v in values):
                    self.effects.append(Effect(EffectOp.ADD, source, None, tuple(values), where))
            return
        if not isinstance(container, list):
            if list(container) != list(before):
                self._refuse(f"changes {where}")
            return
        if len(container) < len(before) or any(a is not b for a, b in zip(container, before)):
            values = [self._value(v, where) for v in container]  # insert, pop, sort, item stores: the whole list
            if all(v is not None for v in values):
                self.effects.append(Effect(EffectOp.REPLACE, source, None, tuple(values), where))
            return
        values = [self._value(v, where) for v in container[len(before):]]
        if values and all(v is not None for v in values):
            self.effects.append(Effect(EffectOp.EXTEND, source, None, tuple(values), where))



_REGISTRY_NAMES = ("_parameters", "_buffers", "_modules")


def _same_registry(d: dict, old: dict) -> bool:
    """Whether registry `d` holds what its copy `old` held: the same keys in order, the same values by position (an
    empty one, most of a module tree's, by its length alone)."""
    return len(d) == len(old) and (not old or list(d) == list(old) and all(map(operator.is_, d.values(),
                                                                               old.values())))


class Registries:
    """The parameter, buffer and submodule dicts of a module tree before a capture. What the program registers
    in them (`register_buffer` in forward, a lazily made submodule) goes behind the watched attributes: it is
    planned as a store where the module has a source (replayed with the graph's real value), else it makes the
    program ineligible; after the capture the dicts are put back."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.before = [(m, name, d, dict(d)) for m in modules for name in _REGISTRY_NAMES  # (a watched module's are
                       if isinstance(d := m.__dict__.get(name), dict)]  # bumping dicts: tracking.py)

    def changed(self) -> list[tuple[torch.nn.Module, str, dict, dict]]:
        return [(m, name, d, old) for m, name, d, old in self.before if not _same_registry(d, old)]

    def plan(self, program: Any) -> None:
        """Note each changed dict on the program's frame (its effects are then planned and undone with the
        containers it read). A module made during the call makes the program ineligible: it runs eagerly, which
        makes the module as eager does (a later capture finds it in the tree)."""
        changed = self.changed()
        made = self.made_modules(changed)
        if made:
            program.mark_ineligible(f"registers {made[0]}, a module it makes during the call")
            self.put_back()  # (the eager call makes it)
            return
        for m, name, d, old in changed:
            source = program.sources.get(id(m))
            if source is None:
                program.mark_ineligible(f"changes {name} of a {type(m).__name__} it did not read")
                continue
            program.note_changed_container(d, Attr(source, name), old)
            program.writes.append(f"{source.name()}.{name} (registered during the call)")

    def made_modules(self, changed: list | None = None) -> list[str]:
        """`Owner.name` of each submodule registered during the call that was not in the tree before (its
        parameters were initialized on fakes: a capture cannot give them eager's values). `changed`: self.changed(),
        where taken already; else only the `_modules` dicts are compared (a capture's one question after the run)."""
        changed = [c for c in changed if c[1] == "_modules"] if changed is not None else [
            c for c in self.before if c[1] == "_modules" and not _same_registry(c[2], c[3])]
        if not changed:  # (no submodule registry changed: nothing made)
            return []
        known = {id(m) for m, *_ in self.before}
        return [f"{type(m).__name__}.{k}" for m, _, d, old in changed
                for k, v in d.items() if old.get(k) is not v and v is not None and id(v) not in known]

    def put_back(self) -> None:
        for _, _, d, old in self.changed():
            put_back(d, old)
