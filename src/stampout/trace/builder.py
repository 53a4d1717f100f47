"""The graph a trace writes: a Builder per graph (the program's, each region's) with its placeholders, constants
and the fx node bound to each fake, and how a torch callable becomes a node target (a function, a method name,
a property)."""

from __future__ import annotations

import builtins
import operator
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.fx as fx

from .. import caches
from ..torch_internals import (
    FakeTensor,
    HigherOrderOperator,
    OpOverload,
    OpOverloadPacket,
    TensorBase,
    append_node,
    enter_inference_mode,
    exit_inference_mode,
)
from .constants import is_constant
from .names import identifier
from .shapes import SIZES, SymbolicValues

_T = torch.Tensor
_TARGETS: dict[Any, tuple[str, Any]] = caches.register({}, "builder node targets")
_OWN_VAL = (FakeTensor, *SIZES)  # placeholder values that are their own meta['val']
_ENTER_INFERENCE = enter_inference_mode
_EXIT_INFERENCE = exit_inference_mode


def is_op(value: Any) -> bool:
    return isinstance(value, (OpOverload, OpOverloadPacket, HigherOrderOperator))


def _method_names() -> dict[Any, str]:
    """Tensor methods defined in Python under another name (`__pow__` is `torch._tensor.pow`)."""
    names: dict[Any, str] = {}
    for cls in (TensorBase, _T):
        for name, value in vars(cls).items():
            for fn in (value, getattr(value, "__wrapped__", None)):
                try:
                    if callable(fn) and fn not in names:
                        names[fn] = name
                except TypeError:
                    pass
    return names


_METHOD_NAMES = _method_names()


def is_property_set(func: Callable) -> bool:
    return getattr(func, "__name__", "") == "__set__" and hasattr(func, "__self__")


def is_property_get(func: Callable) -> bool:
    return getattr(func, "__name__", "") == "__get__" and hasattr(func, "__self__")


_FIXED_TARGETS = {_T.__getitem__: ("call_function", operator.getitem),
                  _T.__setitem__: ("call_function", operator.setitem)}


def node_target(func: Callable) -> tuple[str, Any]:
    """The FX op and target that replays `func`."""
    try:
        return _TARGETS[func]
    except (KeyError, TypeError):
        pass
    name = _METHOD_NAMES.get(func) or getattr(func, "__name__", None)
    if func is _T.__getitem__ or func is _T.__setitem__:
        result = _FIXED_TARGETS[func]
    elif is_property_get(func):
        result = ("call_function", builtins.getattr)
    elif name and (getattr(_T, name, None) is func or _METHOD_NAMES.get(func) == name):
        result = ("call_method", name)
    else:
        result = ("call_function", func)
    try:
        _TARGETS[func] = result
    except TypeError:
        pass
    return result


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any], syms: bool = False) -> Any:
    """`value` with every tensor inside tuples, lists and dicts replaced by `fn(tensor)` (and with `syms`,
    every symbolic size too)."""
    if isinstance(value, torch.Tensor) or syms and isinstance(value, SIZES):
        return fn(value)
    t = type(value)
    if t is tuple or t is list or t is torch.Size and syms:
        return (tuple if t is torch.Size else t)(map_tensors(v, fn, syms) for v in value)
    if t is dict:
        return {k: map_tensors(v, fn, syms) for k, v in value.items()}
    if t is slice:
        return slice(map_tensors(value.start, fn, syms), map_tensors(value.stop, fn, syms),
                     map_tensors(value.step, fn, syms))
    if isinstance(value, tuple) and t is not torch.Size:  # a namedtuple or structseq (has_tensor opens them too)
        items = [map_tensors(v, fn, syms) for v in value]
        return t._make(items) if hasattr(t, "_make") else t(items)
    return value


def has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    t = type(value)
    if t is tuple or t is list or isinstance(value, tuple):
        return any(has_tensor(v) for v in value)
    if t is dict:
        return any(has_tensor(v) for v in value.values())
    if t is slice:
        return has_tensor(value.start) or has_tensor(value.stop) or has_tensor(value.step)
    return False


def has_node(value: Any) -> bool:
    """Whether an FX node is inside `value`'s tuples, lists and dicts."""
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return bool(found)


class Lifting(Protocol):
    """What a Builder asks of the tracer that owns it (tracer.Tracer): fakes' metadata, tensors from outside
    its graph lifted in, and the capture's symbols and region handler (for sizes). A protocol, so that this
    module does not import the tracer, which imports it."""

    symbols: Any
    regions: Any

    def meta_fake(self, t: torch.Tensor) -> FakeTensor: ...

    def lift(self, builder: Builder, t: torch.Tensor) -> fx.Node: ...


class Builder:
    """One FX graph under construction, with the map from live tensors to the nodes that produce them."""

    def __init__(self, tracer: Lifting, parent: Builder | None = None, frame: Any = None) -> None:
        self.tracer = tracer
        self.parent = parent
        self.frame = frame  # the RegionFrame being traced into this graph (None for the outer graph)
        self.graph = fx.Graph()
        self.nodes: dict[int, tuple[torch.Tensor, fx.Node]] = {}
        self._last_placeholder: fx.Node | None = None
        self.operands: list[fx.Node] = []  # for a subgraph: the parent's node feeding each placeholder
        self.submodules: dict[str, Any] = {}  # subgraphs and constant objects, by attribute name
        self._placeholder_names: set[str] = set()
        self._constants: dict[int, fx.Node] = {}
        self._sizes: SymbolicValues | None = None  # size expressions as nodes (symbolic captures only)
        self._inference_base = torch.is_inference_mode_enabled()  # inference_mode as this graph starts
        self._inference: list[tuple[bool, fx.Node]] = []  # inference_mode blocks entered in it, still open

    def sync_inference(self, now: bool | None = None) -> None:
        """Record `torch.inference_mode` blocks entered or left since the last op (a C++ guard, never seen by
        the function mode), so the graph runs its ops in them as eager did; `now=None`: close every block."""
        now = self._inference_base if now is None else now
        while self._inference and self._inference[-1][0] != now:
            self.graph.call_function(_EXIT_INFERENCE, (self._inference.pop()[1],))
        if (self._inference[-1][0] if self._inference else self._inference_base) != now:
            self._inference.append((now, self.graph.call_function(_ENTER_INFERENCE, (now,))))

    def constant(self, value: Any) -> fx.Node:
        """A get_attr node for an object the generated code cannot spell (a class, a local function)."""
        node = self._constants.get(id(value))
        if node is None:
            name = f"_const_{len(self._constants)}"
            self.submodules[name] = value
            node = self._constants[id(value)] = self.graph.get_attr(name)
        return node

    def literal(self, value: Any) -> Any:
        """`value` as an FX argument: containers opened, unprintable objects as get_attr constants."""
        t = type(value)
        if t is tuple or t is list:
            return t(self.literal(v) for v in value)
        if t is dict:
            return {k: self.literal(v) for k, v in value.items()}
        if isinstance(value, tuple) and t is not torch.Size and has_node(value):  # (FX prints namedtuples)
            items = [self.literal(v) for v in value]
            return t._make(items) if hasattr(t, "_make") else tuple(items)
        if t.__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
            return value.item()  # (a NumPy scalar: FX would print NumPy 2's repr, `np.float64(2.0)`)
        if isinstance(value, fx.Node) or is_constant(value) or t is slice or is_op(value):
            return value
        return self.constant(value)

    def placeholder(self, name: str, value: torch.Tensor, meta: bool = True) -> fx.Node:
        """A new placeholder after the existing ones. `meta=False` defers `meta['val']` (see fill_meta)."""
        graph = self.graph
        if name in self._placeholder_names:  # placeholder names are the function's parameter names
            suffix = 1
            while f"{name}_{suffix}" in self._placeholder_names:
                suffix += 1
            name = f"{name}_{suffix}"
        self._placeholder_names.add(name)
        last = self._last_placeholder
        if last is not None:
            node = append_node(graph, "placeholder", name, after=last)
        else:
            node = append_node(graph, "placeholder", name, before=next(iter(graph.nodes)) if len(graph.nodes) else None)
        if node.name != name:  # (taken by a node, or a builtin's: the code begins `add_1 = add`, which a later
            self._placeholder_names.add(node.name)  # parameter named `add_1` must not be: it would be overwritten)
        self._last_placeholder = node
        if isinstance(value, _OWN_VAL):
            node.meta["val"] = value
        elif meta:
            node.meta["val"] = self.tracer.meta_fake(value)
        self.nodes[id(value)] = (value, node)
        return node

    def node_for(self, t: torch.Tensor) -> fx.Node:
        """The node producing `t` in this graph, lifting it as a placeholder when it comes from outside (a
        symbolic size: the node computing it, or a constant where it is specialized)."""
        hit = self.nodes.get(id(t))
        if hit is not None:
            return hit[1]
        if isinstance(t, SIZES):
            return self.size_node(t)
        return self.tracer.lift(self, t)

    def size_node(self, value: Any) -> Any:
        sizes = self._sizes
        if sizes is None:
            symbols = self.tracer.symbols
            if symbols is None:  # a SymInt from another capture's ShapeEnv: its value is all we can use
                return int(value) if isinstance(value, torch.SymInt) else value.node.hint
            if self.parent is None:
                def bind(symbol: Any) -> fx.Node:
                    return symbols.bind_root(self.graph, symbol)
            else:
                def bind(symbol: Any) -> fx.Node:
                    return self.tracer.regions.lift_symbol(self, symbol)
            sizes = self._sizes = SymbolicValues(symbols, self.graph, bind)
        return sizes.node_for(value)

    def symbol_placeholder(self, symbol: Any, value: Any) -> fx.Node:
        """A placeholder for a bound symbol (a size passed into a region's subgraph as an int)."""
        node = self.placeholder(identifier(str(symbol)), value)
        del self.nodes[id(value)]
        return node

    def bind(self, value: torch.Tensor, node: fx.Node) -> None:
        self.nodes[id(value)] = (value, node)
