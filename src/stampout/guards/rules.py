"""Guard kinds: what each checks of the value at a source, the code the generated predicate tests for it, and
how it prints. The values they compare (constant keys, the predicate's small readers) are guards/values.py's.

No notions of regions or captures here: a rule sees one guard and one value.
"""

from __future__ import annotations

import enum
import types
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..sources import MISSING, RESOLVE_HELPERS, CallContext, Source
from ..trace.shapes import size_key
from ..trace.tensormeta import kind_values, meta_values, tensor_kind, tensor_meta
from .hook_keys import NO_HOOKS, describe_hooks, hooks_key, no_hooks
from .values import (
    _length,
    _object_dict,
    const_key,
    is_auto_mark,
    is_constant,
    module_attr,
    show_const,
)


class Expecting(Protocol):
    """What a rule reads of the guard it serves (a `guards.Guard`): the value recorded at capture. (A protocol,
    so that this module does not import guards/guard.py, which imports it.)"""

    expected: Any


class Kind(enum.Enum):
    """What a guard checks of the value at its source; each kind's logic is its `Rule` (`kind.rule`)."""

    TENSOR = "tensor metadata"
    TENSOR_KIND = "tensor kind"  # class, dims, dtype, device, requires_grad, layout: sizes checked by shape guards
    SIZE = "symbolic int"  # an int attribute a symbolic capture made a symbol of: the same expression
    CONST = "constant"
    TYPE = "class"
    ID = "object identity"
    HOOKS = "hooks"
    ABSENT = "attribute absent"
    LEN = "length"
    KEYS = "dict keys"
    MEMBERS = "set members"  # a set of classes (a registry): the same classes, compared by identity
    NO_OVERRIDE = "no per-instance override"  # absent, or one of stampout's transient auto-region marks
    SAME = "same object as"  # expected: another Source that must resolve to the very same object
    DISTINCT = "distinct objects"  # expected: other Sources; no two of them and the source resolve to one object
    NAMESPACE = "names in namespaces"  # source: a NamespaceReads (namespaces.py); it checks itself

    @property
    def rule(self) -> Rule:
        return _RULES[self]


# Note: one rule per guard kind
# Each kind says in one place how a guard of it reads the value at its source (`observe`), whether the value
# passes (`holds`), what the generated predicate tests (`condition`, over the names in `HELPERS`) and how
# values print in a miss report (`show`): Dynamo's GuardBuilder has a method per kind for the same reason.
# The default compares `observe(value) == expected`; a kind overrides what differs.
_RULES: dict[Kind, Rule] = {}


def _rule(kind: Kind) -> Callable[[type[Rule]], type[Rule]]:
    def register(cls: type[Rule]) -> type[Rule]:
        _RULES[kind] = cls()
        return cls

    return register


class Rule:
    """How guards of one kind check, generate code and print (see `Note: one rule per guard kind`)."""

    uses_constant = True  # the predicate binds the guard's expected value (`constant`) as `e<i>`

    def observe(self, value: Any) -> Any:
        """The value as guards of this kind compare it (MISSING: it cannot pass)."""
        return value

    def holds(self, guard: Expecting, value: Any, other: Any) -> bool:
        return self.observe(value) == guard.expected

    def other(self, guard: Expecting, ctx: CallContext, memo: dict) -> Any:
        """A second value the check needs (SAME: the value at the expected source)."""
        return None

    def constant(self, guard: Expecting) -> Any:
        return guard.expected

    def condition(self, guard: Expecting, var: str, const: str) -> str:
        return f"{var} == {const}"

    def fails(self, guard: Expecting, var: str, const: str, bind: Callable[[Source], str]) -> str:
        """The predicate's test that the guard failed."""
        return f"not {self.condition(guard, var, const)}"

    def show(self, guard: Expecting, observed: Any) -> str:
        return repr(observed)

    def _text(self, guard: Expecting, observed: Any) -> str:
        return "<missing>" if observed is MISSING else self.show(guard, observed)

    def actual_text(self, guard: Expecting, value: Any) -> str:
        """A value other than MISSING as this kind compares it, as a user would read it."""
        return self._text(guard, self.observe(value))

    def expected_text(self, guard: Expecting) -> str:
        return self._text(guard, guard.expected)


class _TensorRule(Rule):
    helper = ""

    def condition(self, guard: Expecting, var: str, const: str) -> str:
        return f"(isinstance({var}, _Tensor) and {self.helper}({var}) == {const})"

    def show(self, guard: Expecting, observed: Any) -> str:
        return observed.show()


@_rule(Kind.TENSOR)
class TensorRule(_TensorRule):
    helper = "_tensor_meta"

    def observe(self, value: Any) -> Any:
        return tensor_meta(value) if isinstance(value, torch.Tensor) else MISSING


@_rule(Kind.TENSOR_KIND)
class TensorKindRule(_TensorRule):
    helper = "_tensor_kind"

    def observe(self, value: Any) -> Any:
        return tensor_kind(value) if isinstance(value, torch.Tensor) else MISSING


def _size_key(value: Any) -> Any:
    return size_key(value) if isinstance(value, torch.SymInt) else MISSING


@_rule(Kind.SIZE)
class SizeRule(Rule):
    def observe(self, value: Any) -> Any:
        return _size_key(value)

    def condition(self, guard: Expecting, var: str, const: str) -> str:
        return f"_size_key({var}) == {const}"


_BY_IDENTITY = (type(None), bool)
_BY_VALUE = ((int, "_int"), (str, "_str"), (torch.device, "_device"), (torch.dtype, "_dtype"))  # exact type, then ==


@_rule(Kind.CONST)
class ConstRule(Rule):
    def observe(self, value: Any) -> Any:
        return const_key(value) if value is not MISSING and is_constant(value) else MISSING

    def constant(self, guard: Expecting) -> Any:
        t, value = guard.expected
        return value if t in _BY_IDENTITY or t in dict(_BY_VALUE) else guard.expected

    def condition(self, guard: Expecting, var: str, const: str) -> str:
        t = guard.expected[0]
        if t in _BY_IDENTITY:  # None, True, False: the one object of that value
            return f"{var} is {const}"
        by_value = dict(_BY_VALUE)
        if t in by_value:  # the exact type, then ==: what const_key's (type, value) compares
            return f"(type({var}) is {by_value[t]} and {var} == {const})"
        if t is float:  # a scalar: no container walk
            return f"({var} is not _MISSING and _const_key({var}) == {const})"
        return f"({var} is not _MISSING and _is_constant({var}) and _const_key({var}) == {const})"

    def show(self, guard: Expecting, observed: Any) -> str:
        return show_const(observed)


@_rule(Kind.TYPE)
class TypeRule(Rule):
    """expected: a tuple of the classes that pass (the first is the one seen)."""

    def holds(self, guard: Expecting, value: Any, other: Any) -> bool:
        return type(value) in guard.expected

    def condition(self, guard: Expecting, var: str, const: str) -> str:
        return f"type({var}) in {const}"

    def actual_text(self, guard: Expecting, value: Any) -> str:
        return type(value).__qualname__

    def expected_text(self, guard: Expecting) -> str:
        return guard.expected[0].__qualname__


@_rule(Kind.ID)
class IdRule(Rule):
    def holds(self, guard: Expecting, value: Any, other: Any) -> bool:
        return value is guard.expected

    def condition(self, guard: Expecting, var: str, const: str) -> str:
        return f"{var} is {const}"

    def show(self, guard: Expecting, observed: Any) -> str:
        if isinstance(observed, types.ModuleType):
            return f"<module {observed.__name__} at {id(observed):#x}>"
        name = getattr(observed, "co_qualname", None) or getattr(observed, "__qualname__", None)
        if isinstance(name, str) and not isinstance(observed, type):
            return f"<{type(observed).__name__} {name} at {id(observed):#x}>"
        return f"<{type(observed).__name__} object at {id(observed):#x}>"


@_rule(Kind.HOOKS)
class HooksRule(Rule):
    def observe(self, value: Any) -> Any:
        return hooks_key(value) if isinstance(value, torch.nn.Module) else MISSING

    def condition(self, guard: Expecting, var: str, const: str) -> str:
        if guard.expected == NO_HOOKS:
            return f"(isinstance({var}, _Module) and _no_hooks({var}))"
        return f"(isinstance({var}, _Module) and _hooks_key({var}) == {const})"

    def show(self, guard: Expecting, observed: Any) -> str:
        return "no hooks" if observed == NO_HOOKS else describe_hooks(observed)


@_rule(Kind.ABSENT)
class AbsentRule(Rule):
    def holds(self, guard: Expecting, value: Any, other: Any) -> bool:
        return value is MISSING

    def constant(self, guard: Expecting) -> Any:
        return MISSING

    def condition(self, guard: Expecting, var: str, const: str) -> str:
        return f"{var} is {const}"

    def expected_text(self, guard: Expecting) -> str:
        return "<missing>"


@_rule(Kind.NO_OVERRIDE)
class NoOverrideRule(AbsentRule):
    def holds(self, guard: Expecting, value: Any, other: Any) -> bool:
        return value is MISSING or is_auto_mark(value)

    def condition(self, guard: Expecting, var: str, const: str) -> str:
        return f"({var} is _MISSING or _is_auto_mark({var}))"


@_rule(Kind.LEN)
class LenRule(Rule):
    def observe(self, value: Any) -> Any:
        return _length(value)

    def condition(self, guard: Expecting, var: str, const: str) -> str:
        return f"_length({var}) == {const}"


@_rule(Kind.KEYS)
class KeysRule(Rule):
    def observe(self, value: Any) -> Any:
        return tuple(value) if isinstance(value, dict) else MISSING

    def condition(self, guard: Expecting, var: str, const: str) -> str:
        return f"(isinstance({var}, dict) and tuple({var}) == {const})"


@_rule(Kind.MEMBERS)
class MembersRule(Rule):
    """expected: a set's classes in its iteration order (their metaclasses compare them by identity: see
    regions/objects.py). The order too: `for cls in REGISTRY: if isinstance(m, cls)` takes the first match, and a
    set with the same members iterates in another order after it grew and shrank (its table is larger)."""

    def observe(self, value: Any) -> Any:
        return tuple(value) if type(value) in (set, frozenset) else MISSING

    def condition(self, guard: Expecting, var: str, const: str) -> str:
        return f"((type({var}) is set or type({var}) is frozenset) and tuple({var}) == {const})"

    def show(self, guard: Expecting, observed: Any) -> str:
        return "{" + ", ".join(getattr(c, "__qualname__", "?") for c in observed) + "}"


@_rule(Kind.SAME)
class SameRule(Rule):
    """expected: another Source, which must resolve to the very same object."""

    uses_constant = False

    def holds(self, guard: Expecting, value: Any, other: Any) -> bool:
        return value is other and value is not MISSING

    def other(self, guard: Expecting, ctx: CallContext, memo: dict) -> Any:
        return guard.expected.resolve(ctx, memo)

    def fails(self, guard: Expecting, var: str, const: str, bind: Callable[[Source], str]) -> str:
        return f"{var} is not {bind(guard.expected)} or {var} is _MISSING"

    def actual_text(self, guard: Expecting, value: Any) -> str:
        return f"another object (<{type(value).__name__} object at {id(value):#x}>)"

    def expected_text(self, guard: Expecting) -> str:
        return f"the object at {guard.expected.name()}"


class ApartFrom:
    """The last of a DISTINCT guard's values in a memoized check (instance_facts.py): objects that are fixed by the
    memo's facts (the same objects as on the full pass, which found them distinct), as their ids; the guard's other
    values must be none of them."""

    __slots__ = ("ids",)

    def __init__(self, objects: list[Any]) -> None:
        self.ids = frozenset(map(id, objects))


def _distinct(values: tuple) -> bool:
    """No two of `values` are one object (a weak reference counts as its referent: a WeakKeyDictionary's key);
    none of them one of an `ApartFrom`'s objects."""
    ids = {id(v() if type(v) is weakref.ref else v) for v in values if v is not MISSING}
    return len(ids) == len(values) and (type(values[-1]) is not ApartFrom or values[-1].ids.isdisjoint(ids))


@_rule(Kind.DISTINCT)
class DistinctRule(Rule):
    """expected: other Sources. An identity test the traced Python made (`self is SPECIAL[0]`, `self in table`,
    `table.get(self)`: C code no watch sees) between objects at these sources came out False each time: it does
    while they stay distinct objects. (SAME guards pin the objects that were one.)"""

    uses_constant = False

    def holds(self, guard: Expecting, value: Any, other: Any) -> bool:
        return _distinct((value, *other))

    def other(self, guard: Expecting, ctx: CallContext, memo: dict) -> Any:
        return tuple(source.resolve(ctx, memo) for source in guard.expected)

    def fails(self, guard: Expecting, var: str, const: str, bind: Callable[[Source], str]) -> str:
        return f"not _distinct(({var}, {''.join(bind(s) + ', ' for s in guard.expected)}))"

    def actual_text(self, guard: Expecting, value: Any) -> str:
        return "two of them the same object"

    def expected_text(self, guard: Expecting) -> str:
        return f"distinct objects at {', '.join(s.name() for s in guard.expected[:4])}"


@_rule(Kind.NAMESPACE)
class NamespaceRule(Rule):
    """source: a NamespaceReads (namespaces.py), which checks itself."""

    def holds(self, guard: Expecting, value: Any, other: Any) -> bool:
        return value.unchanged()

    def condition(self, guard: Expecting, var: str, const: str) -> str:
        return f"(({var}.sentinel or _false)() or {var}.unchanged())"  # (one C++ call while nothing moved)

    def actual_text(self, guard: Expecting, value: Any) -> str:
        return value.describe()

    def expected_text(self, guard: Expecting) -> str:
        return "every name as read"


assert set(_RULES) == set(Kind), "every guard kind has its rule"

# The names the rules' conditions use in the generated predicate.
HELPERS = {
    "_tensor_meta": meta_values,  # (plain tuples, equal to the expected records)
    "_tensor_kind": kind_values,
    "_size_key": _size_key,
    "_const_key": const_key,
    "_is_constant": is_constant,
    "_hooks_key": hooks_key,
    "_no_hooks": no_hooks,
    "_length": _length,
    "_is_auto_mark": lambda v: is_auto_mark(v),
    "_object_dict": _object_dict,
    "_module_attr": module_attr,
    "_Tensor": torch.Tensor,
    "_int": int,
    "_str": str,
    "_device": torch.device,
    "_dtype": torch.dtype,
    "_Module": torch.nn.Module,
    "_false": lambda: False,
    "_distinct": _distinct,
    **RESOLVE_HELPERS,
}
