"""Guards: checks on sources, compiled into one generated predicate per reuse entry.

A guard never swallows a bug: a value that is not there resolves to MISSING and fails the check;
any other exception propagates. What each kind checks is its rule (guards/rules.py).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import caches
from ..sources import MISSING, Absolute, Attr, CallContext, Closure, Item, SlotItem, Source, mro_attr
from ..torch_internals import DisableTorchFunction, tensor_check, tensor_guards
from ..trace.names import written_as_is
from ..trace.tensormeta import meta_values, tensor_kind, tensor_meta
from .hook_keys import describe_hooks, hooks_key
from .rules import HELPERS, Kind
from .values import OBJECT_GETATTRIBUTE, const_key, is_auto_mark, is_constant, show_const


def _plain_module_class(cls: type) -> bool:
    """A module class whose attribute lookup is nn.Module's (no custom __getattr__/__getattribute__)."""
    from ..watch.classpatch import original

    return (isinstance(cls, type) and issubclass(cls, torch.nn.Module)
            and original(cls, "__getattr__") is torch.nn.Module.__getattr__
            and original(cls, "__getattribute__") is OBJECT_GETATTRIBUTE)


@dataclass(frozen=True)
class Guard:
    """A check that `source` still resolves to something equal to `expected` under `kind` (see `Kind.rule`)."""

    source: Source
    kind: Kind
    expected: Any
    where: str = ""  # the user's file:line where the value was read

    def holds(self, value: Any, other: Any = None) -> bool:
        """Whether `value` passes (for SAME: `other` is the value at the expected source)."""
        return self.kind.rule.holds(self, value, other)

    def observe(self, value: Any) -> str:
        """The value as this guard compares it, as a user would read it (for explaining a failure)."""
        return "<missing>" if value is MISSING else self.kind.rule.actual_text(self, value)

    def expected_text(self) -> str:
        return self.kind.rule.expected_text(self)

    def condition(self, var: str, const: str) -> str:
        """The expression the generated predicate tests, with the value in `var` and `expected` in `const`."""
        return self.kind.rule.condition(self, var, const)


DEFERRED_LINE = "    pass"  # where a guard left to DeferredTensors stands (for printing: report.annotated)


def _assignment(name: str, source: Source, expr: str, base: str, key: str, operands: list[str]) -> list[str]:
    """`name = expr`, where `expr` is an attribute, item, slot or closure cell read through its helper
    (`getattr(.., _MISSING)`, `_item`, `_slot_item`, `_cell`): the same read inline, with the helper's answer
    (MISSING) on the exceptions it catches. A deep model's per-call check makes several such reads per layer (a KV
    cache's); inline they cost a third of a helper call. The helpers' other cases come out the same: a MISSING
    base has no such attribute and no items (AttributeError, TypeError)."""
    if type(source) is Attr and source.attr == "cell_contents" and expr == source.expr(base):  # (an empty cell:
        read, caught = f"{base}.cell_contents", "(AttributeError, ValueError)"  # ValueError, see _cell_contents)
    elif type(source) is Attr and expr == source.expr(base) and written_as_is(source.attr):
        read, caught = f"{base}.{source.attr}", "AttributeError"
    elif type(source) is Item and expr == f"_item({base}, {key})":  # (a subclass's: its stored item, by _item)
        read = f"{base}[{key}] if type({base}) in _PLAIN_ITEMS else _item({base}, {key})"
        caught = "(KeyError, IndexError, TypeError)"
    elif type(source) is Closure and expr == source.expr(base):  # (no closure, too short, an empty cell: MISSING)
        read = f"fn.__closure__[{source.index}].cell_contents"
        caught = "(AttributeError, TypeError, IndexError, ValueError)"
    elif type(source) is SlotItem and expr == source.expr(base, *operands):
        index = operands[0]
        read, caught = f"{base}[{index}] if type({index}) is _int else _MISSING", "(KeyError, IndexError, TypeError)"
    else:
        return [f"    {name} = {expr}"]
    return ["    try:", f"        {name} = {read}", f"    except {caught}:", f"        {name} = _MISSING"]


def compile_guards(guards: list[Guard], results: list[Source] | None = None,
                   deferred: list[Guard] | None = None) -> Callable[[list[Any], Any], Any]:
    """One generated function `check(leaves, fn, anchors=())` testing every guard, shared prefixes resolved once
(`Anchor` sources read `anchors`).

    It returns False when a guard fails; otherwise True, or, with `results`, the tuple of the values at
    those sources (stamping needs the parameters the guards just resolved). With `deferred` (a list, filled
    here), tensor-metadata guards are left to the caller's one C++ check (`DeferredTensors`): their values follow
    the results in the tuple."""
    namespace: dict[str, Any] = dict(HELPERS)
    lines = ["def check(leaves, fn, anchors=()):"]
    var_of: dict[Source, str] = {}
    # Modules whose class an earlier guard fixes: their attributes are read the way nn.Module resolves them,
    # from the instance dict and the registries, without the Python-level attribute hooks.
    plain = {g.source for g in guards if g.kind is Kind.TYPE and _plain_module_class(g.expected[0])}
    classes = {g.source: g.expected[0] for g in guards if g.source in plain and g.kind is Kind.TYPE}

    def bind(source: Source) -> str:
        if source in var_of:
            return var_of[source]
        if isinstance(source, Absolute):
            name = f"a{len(var_of)}"
            namespace[name] = source.obj
        else:
            parent = source.base()
            base_expr = bind(parent) if parent is not None else ""
            operands = [bind(s) for s in source.operands()]
            name = f"v{len(var_of)}"
            key = repr(source.item) if isinstance(source, Item) else ""
            if isinstance(source, Item) and type(source.item) not in (int, str):  # (a dtype, a weakref: by value)
                namespace[f"k{len(var_of)}"] = source.item
                key = f"k{len(var_of)}"
                expr = f"_item({base_expr}, {key})"
            else:
                expr = source.expr(base_expr, *operands)
            if isinstance(source, Attr) and parent in classes:
                if source.attr == "__dict__":
                    expr = f"_object_dict({base_expr})"
                elif mro_attr(classes[parent], source.attr) is MISSING:
                    expr = f"_module_attr({base_expr}, {source.attr!r})"
            lines.extend(_assignment(name, source, expr, base_expr, key, operands))
        var_of[source] = name
        return name

    later: list[str] = []
    for i, guard in enumerate(guards):
        var = bind(guard.source)
        rule = guard.kind.rule
        const = f"e{i}"
        if deferred is not None and guard.kind is Kind.TENSOR and type(guard.expected.offset) is int:
            deferred.append(guard)  # (class and storage offset too: DeferredTensors checks all of it)
            lines.append(DEFERRED_LINE)
            later.append(var)
            continue
        if rule.uses_constant:
            namespace[const] = rule.constant(guard)
        lines.append(f"    if {rule.fails(guard, var, const, bind)}: return False")
    if results is None and deferred is None:
        lines.append("    return True")
    else:
        values = [bind(source) for source in results or ()] + later
        lines.append(f"    return ({''.join(v + ', ' for v in values)})")
    code = "\n".join(lines)
    exec(_code_of(code), namespace)
    check = namespace["check"]
    check.source_code = code  # type: ignore[attr-defined]
    check.guards, check.variables = guards, var_of  # (for printing it: report.annotated)  # type: ignore[attr-defined]
    return check


@functools.lru_cache(maxsize=64)
def _code_of(code: str) -> types.CodeType:
    """A predicate's code object: the entries of a stack's sharded blocks generate the same source (their constants
    differ in the namespace only), compiled once (sharded_twins.py)."""
    return compile(code, "<stampout guards>", "exec")


caches.register(_code_of, "guards.predicate code")

_storage_offset = torch.Tensor.storage_offset


class DeferredTensors:
    """The metadata checks `compile_guards` left out of a generated predicate (`deferred`), on the tensors it
    returns: one native pass (class, sizes, strides, storage offset, dtype, device, requires_grad, dispatch keys:
    torch_internals.tensor_facts; TensorGuards and the offsets in Python for a few tensors, or where it is not
    available), made from the first tensors that passed the exact check in Python. Where that fails (a tensor
    listed twice, other dispatch keys) the exact check decides, so it admits exactly what the Python guards
    admit: the fast check passing implies it."""

    __slots__ = ("expected", "offsets", "fast")

    def __init__(self, guards: list[Guard]) -> None:
        self.expected = [tuple(g.expected) for g in guards]
        self.offsets = tuple(g.expected.offset for g in guards)  # (TensorGuards does not compare them)
        self.fast: Callable[[tuple], bool] | None = None

    def check(self, values: tuple) -> bool:
        fast = self.fast
        if fast is not None and fast(values):  # (so each value is a tensor of the expected class)
            return True
        if not all(isinstance(v, torch.Tensor) and meta_values(v) == e for v, e in zip(values, self.expected)):
            return False
        if fast is None and len({id(v) for v in values}) == len(values):
            self.fast = self._fast_check(tuple(values))  # (TensorGuards rejects a tensor listed twice)
        return True

    def _fast_check(self, values: tuple) -> Callable[[tuple], bool]:
        def in_python() -> Callable[[tuple], bool]:  # (a few tensors, or no native check (yet))
            guards, offsets = tensor_guards(list(values)), self.offsets
            return lambda now: guards.check(*now) and tuple(map(_storage_offset, now)) == offsets

        return tensor_check(values, in_python, self._forget)

    def _forget(self) -> None:
        self.fast = None  # (the native check is built: the next call's exact check makes it)

    def admit(self, values: tuple, n: int) -> tuple | None:
        """A predicate's results (`n` values, then the tensors whose metadata it deferred) less those tensors,
        when their metadata holds; None when it does not."""
        if len(values) == n:
            return values
        return values[:n] if self.check(values[n:]) else None


def first_failure(guards: list[Guard], ctx: CallContext) -> tuple[int, Guard, Any] | None:
    """The first guard that fails in `ctx`, with its index and the observed value; None if all hold."""
    memo: dict[Source, Any] = {}
    with DisableTorchFunction():
        for i, guard in enumerate(guards):
            value = guard.source.resolve(ctx, memo)
            rule = guard.kind.rule
            if not rule.holds(guard, value, rule.other(guard, ctx, memo)):
                return i, guard, guard.observe(value)
    return None


def check_guards(check: Callable, ctx: CallContext) -> bool:
    with DisableTorchFunction():
        return check(ctx.leaves, ctx.fn)


__all__ = ["Guard", "Kind", "compile_guards", "first_failure", "check_guards", "const_key", "is_constant", "show_const",
           "is_auto_mark", "tensor_meta", "tensor_kind", "hooks_key", "describe_hooks"]
