"""Guards: checks on sources, compiled into one generated predicate per reuse entry.

A guard never swallows a bug: a value that is not there resolves to MISSING and fails the check;
any other exception propagates.
"""

from __future__ import annotations

import enum
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .shapes import size_key
from .sources import MISSING, RESOLVE_HELPERS, Absolute, Attr, CallContext, Item, Source, mro_attr
from .tensormeta import TensorKind, TensorMeta, kind_values, meta_values, tensor_kind, tensor_meta

_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_ATOMS = (torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum, type(Ellipsis))


def is_constant(value: Any) -> bool:
    """Values a trace may bake in as constants: scalars, dtypes, devices, enums and containers of them."""
    if isinstance(value, _SCALARS) or isinstance(value, _ATOMS):
        return True
    if type(value) in (tuple, list, torch.Size, frozenset, set):
        return all(is_constant(v) for v in value)
    if type(value) is dict:
        return all(is_constant(k) and is_constant(v) for k, v in value.items())
    if type(value) in (slice, range):
        return True
    return False


def const_key(value: Any) -> Any:
    """A hashable key equal only for equal constants of the same type (`1`, `1.0`, `True` differ)."""
    t = type(value)
    if t is float:
        return (t, repr(value))  # exact, and NaN equals NaN
    if t in (tuple, list, torch.Size):
        return (t, tuple(const_key(v) for v in value))
    if t in (set, frozenset):
        return (t, frozenset(const_key(v) for v in value))
    if t is dict:
        return (t, tuple((const_key(k), const_key(v)) for k, v in value.items()))
    if t in (slice, range):
        return (t, repr(value))
    return (t, value)


def show_const(key: Any) -> str:
    """A const_key as the value it stands for (`1e-06`, `'silu'`, `(1, 2)`), with its type when it matters."""
    t, value = key
    if t is float:
        return value
    if t in (tuple, list, torch.Size):
        inner = ", ".join(show_const(k) for k in value)
        return f"({inner}{',' if len(value) == 1 else ''})" if t is tuple else f"[{inner}]" if t is list else \
            f"torch.Size([{inner}])"
    if t is dict:
        return "{" + ", ".join(f"{show_const(k)}: {show_const(v)}" for k, v in value) + "}"
    if t in (set, frozenset):
        return "{" + ", ".join(sorted(show_const(k) for k in value)) + "}"
    return repr(value)


def hooks_key(module: torch.nn.Module) -> tuple:
    """The hooks a module call would run (as identities; see `hook_key`)."""
    d = module.__dict__
    return tuple(tuple(map(hook_key, d[name].values())) if d.get(name) else () for name in _HOOK_DICTS)


# Note: hooks guarded by their function
# FSDP2's hooks are bound methods of a per-module FSDPState; stampout runs them eagerly around the captured
# forward of a sharded module (sharded.py), never inside a trace, so the state they are bound to is a per-call
# input of that boundary: they are compared by function, and one trace serves every sharded layer. Any other
# hook may be traced, so it is compared by identity.
_EAGER_HOOK_OWNERS = frozenset({"torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState"})


# Tensor parallelism's hooks are lambdas of `distribute_module`, one per module, closing over the style's
# bound `_prepare_input_fn` / `_prepare_output_fn` (a partial with the layouts) and the DeviceMesh: what they
# do is a function of those values, so they are compared by code and closure values (the style's fields).
_TP_HOOK = ("distribute_module.<locals>.<lambda>", os.path.join("torch", "distributed", "tensor", "_api.py"))


def hook_key(hook: Any) -> Any:
    """What a guard on a module's hooks compares of one hook: the hook itself; for a hook stampout never
    traces (FSDP's, or the per-module wrappers grouped `fully_shard([a, b])` makes of them), its function; for
    tensor parallelism's, its code and closure values."""
    inner, depth = hook, 0
    while inner is not None and depth < 4:  # (functools.wraps chains: `__wrapped__`)
        owner = getattr(inner, "__self__", None)
        if owner is not None:
            cls = type(owner)
            if f"{cls.__module__}.{cls.__qualname__}" in _EAGER_HOOK_OWNERS:
                return inner.__func__
        inner, depth = getattr(inner, "__wrapped__", None), depth + 1
    code = getattr(hook, "__code__", None)
    if code is not None and code.co_qualname == _TP_HOOK[0] and code.co_filename.endswith(_TP_HOOK[1]):
        return HookByValue(code, tuple(_closure_value(cell.cell_contents) for cell in hook.__closure__ or ()))
    return hook


@dataclass(frozen=True)
class HookByValue:
    """A hook compared by its code and the values it closes over (see `hook_key`)."""

    code: Any
    closure: tuple

    def describe(self) -> str:
        return f"{self.code.co_qualname} (compared by value)"


def _closure_value(value: Any) -> Any:
    if isinstance(value, functools.partial):
        fn, owner = getattr(value.func, "__func__", value.func), getattr(value.func, "__self__", None)
        state = None if owner is None else (type(owner), tuple(sorted(vars(owner).items())))
        return (fn, state, value.args, tuple(sorted(value.keywords.items())))
    mesh = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
    if mesh is not None and isinstance(value, mesh):
        return value  # a DeviceMesh compares by value (its ranks, layout and dim names): `mesh["tp"]` makes new ones
    return _Same(value)


class _Same:
    """Equal to another `_Same` of the very same object."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def describe_hooks(observed: tuple) -> str:
    """The hooks `hooks_key` saw, by name and owner (what differs between two calls shows)."""
    parts = [f"{label} [{', '.join(map(_hook_name, hooks))}]"
             for label, hooks in zip(("pre", "fwd", "bwd-pre", "bwd"), observed) if hooks]
    return "hooks " + "; ".join(parts)


def _hook_name(hook: Any) -> str:
    if isinstance(hook, HookByValue):
        return hook.describe()
    name = getattr(hook, "__qualname__", None)
    owner = getattr(hook, "__self__", None)
    if name is None:
        return f"<{type(hook).__name__} object at {id(hook):#x}>"
    if owner is not None:
        return f"{name} of <{type(owner).__name__} object at {id(owner):#x}>"
    return f"{name} at {id(hook):#x}"


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_NO_HOOKS = ((), (), (), ())


def no_hooks(module: torch.nn.Module) -> bool:
    d = module.__dict__
    return not (d.get("_forward_pre_hooks") or d.get("_forward_hooks") or d.get("_backward_pre_hooks")
                or d.get("_backward_hooks"))


_MODULE_GETATTR = torch.nn.Module.__getattr__
_OBJECT_GETATTRIBUTE = object.__getattribute__


def _plain_module_class(cls: type) -> bool:
    """A module class whose attribute lookup is nn.Module's (no custom __getattr__/__getattribute__)."""
    from .classpatch import original

    return (isinstance(cls, type) and issubclass(cls, torch.nn.Module)
            and original(cls, "__getattr__") is _MODULE_GETATTR
            and original(cls, "__getattribute__") is _OBJECT_GETATTRIBUTE)


def _object_dict(v: Any) -> Any:
    try:
        return _OBJECT_GETATTRIBUTE(v, "__dict__")
    except AttributeError:
        return MISSING


def _module_attr(v: Any, name: str) -> Any:
    """`getattr(module, name)` for a name its class does not define, as nn.Module resolves it."""
    try:
        d = _OBJECT_GETATTRIBUTE(v, "__dict__")
    except AttributeError:
        return MISSING
    if name in d:
        return d[name]
    for registry in ("_parameters", "_buffers", "_modules"):
        r = d.get(registry)
        if r is not None and name in r:
            return r[name]
    return MISSING


def is_auto_mark(value: Any) -> bool:
    """Whether `value` is the bound region wrapper `stampout.auto_regions` puts on a module for a capture."""
    return getattr(getattr(value, "__func__", None), "__stampout_auto__", False) is True


def _length(value: Any) -> Any:
    try:
        return len(value)
    except TypeError:
        return MISSING


class Kind(enum.Enum):
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
    NO_OVERRIDE = "no per-instance override"  # absent, or one of stampout's transient auto-region marks
    SAME = "same object as"  # expected: another Source that must resolve to the very same object
    NAMESPACE = "names in namespaces"  # source: a NamespaceReads (namespaces.py); it checks itself


# How each kind reads its value, and the expression the generated predicate tests.
_OBSERVE: dict[Kind, Callable[[Any], Any]] = {
    Kind.TENSOR: lambda v: tensor_meta(v) if isinstance(v, torch.Tensor) else MISSING,
    Kind.TENSOR_KIND: lambda v: tensor_kind(v) if isinstance(v, torch.Tensor) else MISSING,
    Kind.SIZE: lambda v: size_key(v) if isinstance(v, torch.SymInt) else MISSING,
    Kind.CONST: lambda v: const_key(v) if v is not MISSING and is_constant(v) else MISSING,
    Kind.TYPE: lambda v: type(v),
    Kind.ID: lambda v: v,
    Kind.HOOKS: lambda v: hooks_key(v) if isinstance(v, torch.nn.Module) else MISSING,
    Kind.ABSENT: lambda v: v,
    Kind.NO_OVERRIDE: lambda v: v,
    Kind.LEN: _length,
    Kind.KEYS: lambda v: tuple(v) if isinstance(v, dict) else MISSING,
}
_HELPERS = {
    "_tensor_meta": meta_values,  # (plain tuples, equal to the expected records)
    "_tensor_kind": kind_values,
    "_size_key": lambda v: size_key(v) if isinstance(v, torch.SymInt) else MISSING,
    "_const_key": const_key,
    "_is_constant": is_constant,
    "_hooks_key": hooks_key,
    "_no_hooks": no_hooks,
    "_length": _length,
    "_is_auto_mark": lambda v: is_auto_mark(v),
    "_object_dict": _object_dict,
    "_module_attr": _module_attr,
    "_Tensor": torch.Tensor,
    "_Module": torch.nn.Module,
    "_false": lambda: False,
    **RESOLVE_HELPERS,
}


@dataclass(frozen=True)
class Guard:
    """A check that `source` still resolves to something equal to `expected` under `kind`."""

    source: Source
    kind: Kind
    expected: Any
    where: str = ""  # the user's file:line where the value was read

    def holds(self, value: Any, other: Any = None) -> bool:
        """Whether `value` passes (for SAME: `other` is the value at the expected source)."""
        if self.kind is Kind.SAME:
            return value is other and value is not MISSING
        if self.kind is Kind.TYPE:
            return type(value) in self.expected
        if self.kind is Kind.ABSENT:
            return value is MISSING
        if self.kind is Kind.NO_OVERRIDE:
            return value is MISSING or is_auto_mark(value)
        if self.kind is Kind.ID:
            return value is self.expected
        if self.kind is Kind.NAMESPACE:
            return value.unchanged()
        return _OBSERVE[self.kind](value) == self.expected

    def observe(self, value: Any) -> str:
        """The value as this guard compares it, as a user would read it (for explaining a failure)."""
        if value is MISSING:
            return "<missing>"
        if self.kind is Kind.TYPE:
            return type(value).__qualname__
        if self.kind is Kind.SAME:
            return f"another object (<{type(value).__name__} object at {id(value):#x}>)"
        if self.kind is Kind.NAMESPACE:
            return value.describe()
        return self._show(_OBSERVE[self.kind](value))

    def expected_text(self) -> str:
        if self.kind is Kind.TYPE:
            return self.expected[0].__qualname__
        if self.kind in (Kind.ABSENT, Kind.NO_OVERRIDE):
            return "<missing>"
        if self.kind is Kind.SAME:
            return f"the object at {self.expected.name()}"
        if self.kind is Kind.NAMESPACE:
            return "every name as read"
        return self._show(self.expected)

    def _show(self, observed: Any) -> str:
        if observed is MISSING:
            return "<missing>"
        if self.kind is Kind.CONST:
            return show_const(observed)
        if isinstance(observed, (TensorMeta, TensorKind)):
            return observed.show()
        if self.kind is Kind.HOOKS:
            return "no hooks" if observed == _NO_HOOKS else describe_hooks(observed)
        if self.kind is Kind.ID:
            return f"<{type(observed).__name__} object at {id(observed):#x}>"
        return repr(observed)

    def condition(self, var: str, const: str) -> str:
        k = self.kind
        if k is Kind.TENSOR:
            return f"(isinstance({var}, _Tensor) and _tensor_meta({var}) == {const})"
        if k is Kind.TENSOR_KIND:
            return f"(isinstance({var}, _Tensor) and _tensor_kind({var}) == {const})"
        if k is Kind.SIZE:
            return f"_size_key({var}) == {const}"
        if k is Kind.CONST:
            if self.expected[0] in (type(None), bool, int, float, str):  # a scalar: no container walk
                return f"({var} is not _MISSING and _const_key({var}) == {const})"
            return f"({var} is not _MISSING and _is_constant({var}) and _const_key({var}) == {const})"
        if k is Kind.TYPE:
            return f"type({var}) in {const}"
        if k in (Kind.ID, Kind.ABSENT):
            return f"{var} is {const}"
        if k is Kind.NO_OVERRIDE:
            return f"({var} is _MISSING or _is_auto_mark({var}))"
        if k is Kind.HOOKS:
            if self.expected == _NO_HOOKS:
                return f"(isinstance({var}, _Module) and _no_hooks({var}))"
            return f"(isinstance({var}, _Module) and _hooks_key({var}) == {const})"
        if k is Kind.KEYS:
            return f"(isinstance({var}, dict) and tuple({var}) == {const})"
        if k is Kind.NAMESPACE:
            return f"(({var}.sentinel or _false)() or {var}.unchanged())"  # (one C++ call while nothing moved)
        return f"_length({var}) == {const}"


def compile_guards(guards: list[Guard], results: list[Source] | None = None) -> Callable[[list[Any], Any], Any]:
    """One generated function `check(leaves, fn, anchors=())` testing every guard, shared prefixes resolved once
(`Anchor` sources read `anchors`).

    It returns False when a guard fails; otherwise True, or, with `results`, the tuple of the values at
    those sources (stamping needs the parameters the guards just resolved)."""
    namespace: dict[str, Any] = dict(_HELPERS)
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
            if isinstance(source, Item) and type(source.item) not in (int, str):  # (a dtype, a weakref: by value)
                namespace[f"k{len(var_of)}"] = source.item
                expr = f"_item({base_expr}, k{len(var_of)})"
            else:
                expr = source.expr(base_expr, *operands)
            if isinstance(source, Attr) and parent in classes:
                if source.attr == "__dict__":
                    expr = f"_object_dict({base_expr})"
                elif mro_attr(classes[parent], source.attr) is MISSING:
                    expr = f"_module_attr({base_expr}, {source.attr!r})"
            lines.append(f"    {name} = {expr}")
        var_of[source] = name
        return name

    for i, guard in enumerate(guards):
        var = bind(guard.source)
        if guard.kind is Kind.SAME:
            lines.append(f"    if {var} is not {bind(guard.expected)} or {var} is _MISSING: return False")
            continue
        const = f"e{i}"
        namespace[const] = guard.expected if guard.kind not in (Kind.ABSENT, Kind.NO_OVERRIDE) else MISSING
        lines.append(f"    if not {guard.condition(var, const)}: return False")
    if results is None:
        lines.append("    return True")
    else:
        values = [bind(source) for source in results]
        lines.append(f"    return ({''.join(v + ', ' for v in values)})")
    code = "\n".join(lines)
    exec(compile(code, "<stampout guards>", "exec"), namespace)
    check = namespace["check"]
    check.source_code = code  # type: ignore[attr-defined]
    return check


def first_failure(guards: list[Guard], ctx: CallContext) -> tuple[int, Guard, Any] | None:
    """The first guard that fails in `ctx`, with its index and the observed value; None if all hold."""
    memo: dict[Source, Any] = {}
    with torch._C.DisableTorchFunction():
        for i, guard in enumerate(guards):
            value = guard.source.resolve(ctx, memo)
            other = guard.expected.resolve(ctx, memo) if guard.kind is Kind.SAME else None
            if not guard.holds(value, other):
                return i, guard, guard.observe(value)
    return None


def check_guards(check: Callable, ctx: CallContext) -> bool:
    with torch._C.DisableTorchFunction():
        return check(ctx.leaves, ctx.fn)


__all__ = ["Guard", "Kind", "compile_guards", "first_failure", "check_guards", "const_key", "is_constant",
           "tensor_meta", "hooks_key"]
