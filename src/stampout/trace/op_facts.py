"""Facts about ops, kept once: which write in place (and into which argument), which always make views, which
may return memory of an argument, which need a tensor's value, which draw random numbers.

Every pass asks here rather than keeping its own list: the tracer (in-place ops on fakes, view properties,
data-dependent calls), known constant values (a write forgets them), the region layer (outputs that are views
of one base) and the split backend (regions that write or return their inputs). A target is what the tracer
sees (`torch.Tensor.add_`, `torch.add`, `torch.ops.aten.add_.Tensor`) or what an FX node holds (the method
name `"add_"`, `operator.getitem`, `builtins.getattr`). Imports nothing of stampout but its cache registry.
"""

from __future__ import annotations

import builtins
import inspect
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import fx

from .. import caches
from ..torch_internals import FunctionSchema, HigherOrderOperator, OpOverload, OpOverloadPacket, pytree

_T = torch.Tensor

# Note: an op's name is its method or function name, without an aten overload (`add_.Tensor` is `add_`).
# `x += y` reaches the tracer as `Tensor.__iadd__`; these are the in-place operator methods.
IN_PLACE_OPERATORS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__imatmul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__ilshift__", "__irshift__", "__iand__", "__ior__", "__ixor__",
})

# Ops whose result is always a view of their first argument (never a copy: not reshape, flatten, contiguous,
# to; not detach, whose view does not carry gradients).
ALWAYS_VIEWS = frozenset({
    "view", "view_as", "unflatten", "transpose", "permute", "t", "narrow", "select", "expand", "expand_as",
    "squeeze", "unsqueeze", "as_strided", "diagonal", "movedim", "moveaxis", "swapaxes", "swapdims", "split",
    "chunk", "unbind", "tensor_split", "split_with_sizes", "alias", "unfold", "view_as_real", "view_as_complex",
})

# Tensor properties that make a new view (`x.mT`): computed on fakes and recorded as `getattr(x, "mT")`.
VIEW_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag", "data"})

# Ops whose result is a tuple of views of their first argument.
SPLITS = frozenset({"split", "chunk", "unbind", "tensor_split", "split_with_sizes"})

# Ops whose result may share memory with their first argument: the views (hsplit and friends too), and ops
# that can return `self` (reshape of a contiguous tensor, `to` the same dtype, `contiguous`, `detach`).
MAY_ALIAS = ALWAYS_VIEWS | VIEW_PROPERTIES | frozenset({
    "reshape", "reshape_as", "flatten", "hsplit", "vsplit", "dsplit", "detach", "contiguous", "to", "type",
    "type_as", "float", "double", "half", "bfloat16", "int", "long", "bool", "cpu", "cuda", "getitem",
    "__getitem__", "identity", "clone_if_needed",
})

# Calls that need a tensor's value in Python, and what to call them in an error.
NEEDS_VALUE: dict[Callable, str] = {
    _T.__bool__: "bool(tensor)",
    _T.item: "tensor.item()",
    _T.tolist: "tensor.tolist()",
    _T.__int__: "int(tensor)",
    _T.__float__: "float(tensor)",
    _T.__index__: "using a tensor as an index",
    _T.__complex__: "complex(tensor)",
    _T.numpy: "tensor.numpy()",
}

# Tensor facts that are neither metadata nor value (`p.grad is None`, `x._version`, `x.is_leaf`, `x._base`, an
# address, shared or pinned memory), read by user code: no guard sees them change between calls, so a trace that
# reads one is not reused and a compiled program runs eagerly. (`requires_grad` is guarded: not here.) Where the
# fake tensor a capture runs on cannot answer, `capture` refuses: "fake" (fakes have no memory), "region" (a
# region's trace runs on fresh leaf fakes of its inputs: not views, no grad_fn), "" (a fake answers as eager).
UNGUARDED_READS: Mapping[Callable, tuple[str, str]] = MappingProxyType({
    _T.grad.__get__: (".grad", ""),
    _T._grad.__get__: ("._grad", ""),
    _T._version.__get__: ("._version", ""),
    _T.is_inference: (".is_inference()", ""),  # (no guard: a tensor made in inference mode, or its clone, fits)
    _T.is_leaf.__get__: (".is_leaf", "region"),
    _T.grad_fn.__get__: (".grad_fn", "region"),
    _T._grad_fn.__get__: ("._grad_fn", "region"),
    _T.output_nr.__get__: (".output_nr", "region"),
    _T.retains_grad.__get__: (".retains_grad", "region"),
    _T._base.__get__: ("._base", "region"),
    _T._is_view: ("._is_view()", "region"),
    _T.data_ptr: (".data_ptr()", "fake"),
    _T._cdata.__get__: ("._cdata", "fake"),
    _T.untyped_storage: (".untyped_storage()", "fake"),
    _T.storage: (".storage()", "fake"),
    _T._typed_storage: ("._typed_storage()", "fake"),
    _T.is_shared: (".is_shared()", "fake"),
    _T.is_pinned: (".is_pinned()", "fake"),
    _T.share_memory_: (".share_memory_()", "fake"),
})

# Words in the names of ops whose result is not a function of their inputs.
_RANDOM = ("rand", "normal", "bernoulli", "dropout", "multinomial", "poisson", "uniform", "exponential",
           "geometric", "cauchy", "log_normal", "random", "empty", "seed")


def op_name(target: Any) -> str:
    """The op's name: a method name as it is, a function's `__name__` without an aten overload."""
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", "") or ""
    return name.partition(".")[0] if isinstance(target, OpOverload) else name


def deterministic(func: Callable) -> bool:
    name = op_name(func).lower()
    return not any(word in name for word in _RANDOM)


_DRAWS: dict[Any, bool] = caches.register({}, "op_facts functions that draw random numbers")


def draws_random(func: Callable) -> bool:
    """Whether a torch function draws from a generator (`randn`, `dropout`, `normal_`; `empty` does not)."""
    try:
        return _DRAWS[func]
    except (KeyError, TypeError):
        name = op_name(func).lower()
        draws = any(word in name for word in _RANDOM if word != "empty")
        try:
            _DRAWS[func] = draws
        except TypeError:
            pass
        return draws


# Words of the names of ops whose kernels check their inputs' values (indices in range, a matrix positive-definite,
# probabilities valid, an assert): their errors are not seen on fakes. All of torch.linalg, and ops of namespaces
# other than aten's and prims' (a custom kernel may check anything).
_VALUE_CHECKS = frozenset((
    "index", "gather", "scatter", "embedding", "take", "put", "hot", "nll", "entropy", "ctc", "bincount", "narrow",
    "multinomial", "interleave", "bernoulli", "binomial", "poisson", "cholesky", "inverse", "inv", "solve", "lu",
    "ldl", "eig", "eigh", "eigvals", "eigvalsh", "svd", "svdvals", "pinv", "lstsq", "lobpcg", "assert", "check",
    "getitem", "setitem", "sparse", "unpool", "segment", "searchsorted", "bucketize", "histc", "histogram", "linalg",
))
_FAILS_ON_VALUES: dict[Any, bool] = caches.register({}, "op_facts functions whose kernels check values")


def may_fail_on_values(func: Callable) -> bool:
    """Whether a torch call may raise on its inputs' values alone (`cholesky`, `index_select`, `x[idx]`)."""
    try:
        return _FAILS_ON_VALUES[func]
    except (KeyError, TypeError):
        packet = getattr(func, "_overloadpacket", func)
        fails = ((isinstance(packet, OpOverloadPacket) and packet._qualified_op_name.split("::")[0]
                     not in ("aten", "prims"))
                 or not _VALUE_CHECKS.isdisjoint(re.split(r"[^a-z]+", op_name(func).lower())))
        try:
            _FAILS_ON_VALUES[func] = fails
        except TypeError:
            pass
        return fails


_MUTABLE: dict[Any, tuple[FunctionSchema, ...]] = caches.register({}, "op_facts mutable schemas of packets")


def _overloads(target: Any) -> list[OpOverload]:
    if isinstance(target, OpOverloadPacket):
        return [getattr(target, name) for name in target.overloads()]
    return [target] if isinstance(target, OpOverload) else []


def mutable_schemas(target: Any) -> tuple[FunctionSchema, ...]:
    """The schemas of `target` that write one of their arguments (`Tensor(a!) m`): an overload's own; of a packet
    (`torch.ops.ns.op`, which a call resolves to one of its overloads), every overload's that does."""
    if isinstance(target, OpOverloadPacket):
        mutable = _MUTABLE.get(target)
        if mutable is None:
            mutable = _MUTABLE[target] = tuple(op._schema for op in _overloads(target) if op._schema.is_mutable)
        return mutable
    schema = getattr(target, "_schema", None)
    return (schema,) if isinstance(schema, FunctionSchema) and schema.is_mutable else ()


def custom_op_writes(target: Any) -> bool:
    """A custom (not aten or prims) op, or packet (any overload), whose schema writes one of its arguments (what
    torch's FunctionalTensorMode refuses inside a subgraph, see backends/inline.py)."""
    return any(op.namespace not in ("aten", "prims") and op._schema.is_mutable for op in _overloads(target))


def writes_in_place(target: Any, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Whether calling `target(*args, **kwargs)` may write into an existing tensor: an in-place method or op
    (`add_`, `x += y`, `x[i] = v`, an aten overload with a mutable schema such as `aten.add_.Tensor`, a packet
    whose overload writes an argument the call passes), `out=`, or a function asked to work `inplace`."""
    kwargs = kwargs or {}
    mutable = mutable_schemas(target)
    if mutable and (not isinstance(target, OpOverloadPacket) or _written_by(mutable, args, kwargs)):
        return True
    name = op_name(target)
    dunder = name.startswith("__") and name.endswith("__")
    return (name.endswith("_") and not dunder or name in IN_PLACE_OPERATORS or name in ("setitem", "__setitem__")
            or "out" in kwargs or _asked_inplace(target, args, kwargs))


def written(target: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments an in-place call writes: those its schema marks written, else the first argument and
    what `out=` holds."""
    mutable = mutable_schemas(target)
    if mutable:
        return _written_by(mutable, args, kwargs)
    values = [args[0]] if args else []
    return values + pytree.tree_leaves(kwargs.get("out", []))


def _written_by(schemas: tuple[FunctionSchema, ...], args: tuple, kwargs: dict) -> list[Any]:
    """The arguments of a call that the written arguments of `schemas` name (a packet's several: each value once)."""
    values: list[Any] = []
    for schema in schemas:
        found = []
        for i, argument in enumerate(schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                if i < len(args):
                    found.append(args[i])
                elif argument.name in kwargs:
                    found.append(kwargs[argument.name])
        values.extend(v for v in found if not any(v is known for known in values))
    return values


def may_alias(target: Any) -> bool:
    """Whether a call's result may share memory with its arguments: a view-like op, a tensor property
    (`getattr(x, "mT")`, `x.data`), an `operator` item, an aten op whose schema says its result aliases."""
    if target is builtins.getattr:
        return True
    schema = getattr(target, "_schema", None)
    return (op_name(target) in MAY_ALIAS or getattr(target, "__module__", "") == "_operator"
            or isinstance(schema, FunctionSchema) and any(r.alias_info is not None for r in schema.returns))


_INPLACE_AT: dict[Any, int | None] = caches.register({}, "op_facts inplace positions")


def inplace_position(func: Callable) -> int | None:
    """The position of a function's `inplace` parameter (`F.relu(x, inplace=True)`), if it has one."""
    try:
        return _INPLACE_AT[func]
    except (KeyError, TypeError):
        pass
    position = None
    try:
        names = list(inspect.signature(func).parameters)
        position = names.index("inplace") if "inplace" in names else None
    except (TypeError, ValueError):
        pass
    try:
        _INPLACE_AT[func] = position
    except TypeError:
        pass
    return position


def _asked_inplace(target: Any, args: tuple, kwargs: dict) -> bool:
    """`F.relu(x, inplace=True)` and friends: a function with an `inplace` parameter, asked to use it."""
    if "inplace" in kwargs:
        return kwargs["inplace"] is True
    if isinstance(target, str) or not callable(target):
        return False
    position = inplace_position(target)
    return position is not None and position < len(args) and args[position] is True


def drawn_at_random(node: Any, submodules: dict[str, Any] | None = None) -> bool:
    """Whether an FX node's value depends on a random draw: an op that draws among its inputs, or a call of a
    subgraph (found by name in `submodules`; one not found counts as drawing) with such an op in it."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("call_function", "call_method") and _draws(n.target):
            return True
        if n.op == "call_function" and isinstance(n.target, HigherOrderOperator):
            graphs = [getattr((submodules or {}).get(a.target), "graph", None) for a in n.args
                      if isinstance(a, fx.Node) and a.op == "get_attr"]
            if not graphs or any(g is None or any(drawn_at_random(m, submodules) for m in g.nodes) for g in graphs):
                return True
        todo.extend(n.all_input_nodes)
    return False


def _draws(target: Any) -> bool:
    return draws_random(target) and "normalize" not in op_name(target)  # (F.normalize: "normal" in its name)


# Saved-tensor hooks of torch's own that change only where a saved tensor lives until backward, never its value
# (activation checkpointing drops and recomputes it, save_on_cpu moves it): a graph without them computes the same.
_VALUE_KEEPING_HOOKS = ("torch.utils.checkpoint", "torch.autograd.graph")


def saved_hooks_keep_values(pack_hook: Any) -> bool:
    """Whether saved-tensor hooks with this pack function are torch's own value-keeping ones."""
    return getattr(pack_hook, "__module__", None) in _VALUE_KEEPING_HOOKS
