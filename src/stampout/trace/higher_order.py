"""Higher-order ops users write — `torch.cond`, `while_loop`, `map`, `scan`, `associative_scan` — as graph nodes.

Each function argument of the op is traced by the capture tracer, on fresh fakes, into a subgraph of its own
(a `BranchBuilder`); the outer tensors and sizes a function reads (closures, parameters) are lifted into it
and passed as extra operands, in the operand list torch appends them to for that op (`cond`'s operands, the
others' additional inputs). Every function of one op takes the same extra operands in the same order. The
op's outputs come from running the op itself on fakes with the traced subgraphs (torch's own checks that the
branches agree run there), and the op is recorded as one node whose function arguments are `get_attr`s of
the subgraphs, as torch.export writes them.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..errors import CaptureError, message
from ..torch_internals import DisableTorchFunction, pytree
from .builder import Builder, map_tensors
from .frames import user_location
from .meta import NOT_HANDLED
from .names import identifier
from .shapes import SIZES, SymbolicValues
from .tracer import Tracer

_HOPS = torch.ops.higher_order


class BranchBuilder(Builder):
    """The subgraph of one function argument of a higher-order op: what it reads from outside is lifted."""

    def __init__(self, tracer: Tracer, parent: Builder) -> None:
        super().__init__(tracer, parent, None)
        self.captured: dict[int, Any] = {}  # id -> outer tensor or symbolic size it lifted, in lifting order
        self.lifted: dict[int, fx.Node] = {}  # id -> its placeholder
        self.spec: pytree.TreeSpec | None = None  # the structure of the function's output

    def node_for(self, t: Any) -> fx.Node:
        hit = self.nodes.get(id(t))
        if hit is not None:
            return hit[1]
        if isinstance(t, SIZES):
            return self.size_node(t)
        return self.lift_outer(t)

    def lift_outer(self, value: Any) -> fx.Node:
        """A placeholder for `value` from the enclosing graph (made once)."""
        hit = self.lifted.get(id(value))
        if hit is not None:
            return hit
        self.parent.node_for(value) if isinstance(value, torch.Tensor) else None  # lifted up the chain first
        name = identifier(self.tracer.names.find(value)[0]) if self._named(value) else "captured"
        node = self.placeholder(name, value)
        if isinstance(value, SIZES):
            del self.nodes[id(value)]
        self.captured[id(value)] = value
        self.lifted[id(value)] = node
        return node

    def _named(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and self.tracer.names.find(value) is not None

    def size_node(self, value: Any) -> Any:
        if self._sizes is None and self.tracer.symbols is not None:
            symbols = self.tracer.symbols

            def bind(symbol: Any) -> fx.Node:
                return self.lift_outer(symbols.value_of(symbol))

            self._sizes = SymbolicValues(symbols, self.graph, bind)
        return super().size_node(value)

    def outer_node(self, value: Any) -> Any:
        return self.parent.size_node(value) if isinstance(value, SIZES) else self.parent.node_for(value)


@dataclasses.dataclass(frozen=True)
class OpSignature:
    """Where an op's functions are among its arguments, what each is called with, and where the extra
    operands they read go."""

    fns: tuple[int, ...]
    extra: int  # the argument (a tuple or list) the lifted operands are appended to
    inputs: Callable[[tuple], list[list[Any]]]  # per function: the values it is called with (before extras)
    shaped_by: int | None  # the function whose output structure the op's result has (None: the op's own)


def _slices(xs: list) -> list:
    return [x[0] for x in xs]


_SIGNATURES: dict[Any, OpSignature] = {
    _HOPS.cond: OpSignature((1, 2), 3, lambda a: [list(a[3]), list(a[3])], 0),
    _HOPS.while_loop: OpSignature((0, 1), 3, lambda a: [[*a[2], *a[3]], [*a[2], *a[3]]], 1),
    _HOPS.map_impl: OpSignature((0,), 2, lambda a: [[*_slices(a[1]), *a[2]]], 0),
    _HOPS.scan: OpSignature((0,), 3, lambda a: [[*a[1], *_slices(a[2]), *a[3]]], None),
    _HOPS.associative_scan: OpSignature((0,), 2, lambda a: [[*_slices(a[1]), *_slices(a[1]), *a[2]]], None),
}


def handles(func: Any) -> bool:
    return func in _SIGNATURES


def call_if_handled(tracer: Tracer, func: Any, args: tuple, kwargs: dict) -> Any:
    """The tracer's hook for higher-order ops: `call` for those handled here, else NOT_HANDLED."""
    return call(tracer, func, args, kwargs) if handles(func) else NOT_HANDLED


def _fresh(value: Any) -> Any:
    """A new fake input with `value`'s metadata (sizes and ints as they are)."""
    if not isinstance(value, torch.Tensor):
        return value
    with DisableTorchFunction():
        fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
        if value.requires_grad and torch.is_grad_enabled():
            fake.requires_grad_(True)
    return fake


def _unsupported(what: str) -> CaptureError:
    return CaptureError(message(what, user_location(), "rewrite it with torch.where or plain Python loops"))


def _trace(tracer: Tracer, fn: Callable, inputs: list[Any], op: str, single: bool = False) -> BranchBuilder:
    """Trace `fn(*inputs)` into a new subgraph of the current graph, returning a tuple of its output's leaves
    (`single`: its one output itself, as a while_loop's condition)."""
    branch = BranchBuilder(tracer, tracer.builder)
    fakes = [_fresh(v) for v in inputs]
    for i, fake in enumerate(fakes):
        if not isinstance(fake, (torch.Tensor, int)):
            raise _unsupported(f"a {type(fake).__name__} operand of a higher-order op (tensors and ints only)")
        if isinstance(fake, torch.Tensor):
            branch.placeholder(f"arg{i}", fake)
        else:
            branch.graph.placeholder(f"arg{i}")  # a Python int operand: baked into the subgraph
    tracer.builders.append(branch)
    try:
        with tracer.mode:  # torch popped it to call the op: the function's torch calls are traced again
            out = fn(*fakes) if tracer.regions is None else tracer.regions.run_branch(fn, fakes, op)
    finally:
        tracer.builders.pop()
    leaves, branch.spec = pytree.tree_flatten(out)
    for leaf in leaves:
        if not isinstance(leaf, (torch.Tensor, *SIZES, int, bool)):
            raise _unsupported(f"a function of a higher-order op returned a {type(leaf).__name__}")
    nodes = tuple(branch.node_for(x) if isinstance(x, (torch.Tensor, *SIZES)) else x for x in leaves)
    branch.graph.output(nodes[0] if single and len(nodes) == 1 else nodes)
    return branch


def _order_extras(branch: BranchBuilder, extras: list[Any]) -> None:
    """Give `branch` a placeholder for every value in `extras`, after its own inputs, in that order."""
    for value in extras:
        branch.lift_outer(value)
    graph = branch.graph
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for value in extras:
        first.prepend(branch.lifted[id(value)])


def call(tracer: Tracer, func: Any, args: tuple, kwargs: dict) -> Any:
    """Trace the functions of higher-order op `func`, run it on fakes and record it as one node."""
    if not all(type(v) in (str, int, bool, type(None)) for v in kwargs.values()):  # (torch 2.14's map_impl
        raise _unsupported(f"{func.__name__} called with keyword arguments {sorted(kwargs)}")  # passes a str)
    sig = _SIGNATURES[func]
    for value in pytree.tree_leaves([a for i, a in enumerate(args) if i not in sig.fns]):
        if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool) and func is not _HOPS.cond:
            raise _unsupported(f"{func.__name__} with an int operand ({value}): pass it as a tensor")
    branches = [_trace(tracer, args[i], inputs, f"torch.{func.__name__}", func is _HOPS.while_loop and i == 0)
                for i, inputs in zip(sig.fns, sig.inputs(args))]
    extras: dict[int, Any] = {}
    for branch in branches:
        extras.update(branch.captured)
    for branch in branches:
        _order_extras(branch, list(extras.values()))
    gms = [fx.GraphModule(b.submodules, b.graph, class_name=f"{func.__name__}_fn") for b in branches]
    full = list(args)
    full[sig.extra] = (*args[sig.extra], *extras.values())
    for i, gm in zip(sig.fns, gms):
        full[i] = gm
    if func is _HOPS.while_loop and tracer.fake_mode.shape_env is None:
        out = _loop_outputs(branches[1], args[2])  # torch's fake while_loop needs a ShapeEnv
    else:
        out = _run_on_fakes(tracer, func, full, kwargs)
    builder = tracer.builder
    node_args = []
    for i, value in enumerate(full):
        if i in sig.fns:
            node_args.append(_subgraph(builder, f"{func.__name__}_fn", value))
        else:
            node_args.append(builder.literal(map_tensors(value, builder.node_for, True)))
    node = builder.graph.call_function(func, tuple(node_args), dict(kwargs))
    tracer._annotate(node, out)
    _bind(builder, node, out)
    if sig.shaped_by is None:
        return out
    spec = branches[sig.shaped_by].spec
    for branch in branches:
        if func is _HOPS.cond and branch.spec != spec:
            raise _unsupported(f"the branches of torch.cond return different structures: {spec} and {branch.spec}")
    return pytree.tree_unflatten(list(out), spec)


def _bind(builder: Builder, node: fx.Node, value: Any) -> None:
    """Bind each tensor of the op's result (tuples of tuples) to a getitem chain from `node`."""
    if isinstance(value, torch.Tensor):
        builder.bind(value, node)
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            if isinstance(item, (torch.Tensor, tuple, list)):
                item_node = builder.graph.call_function(operator.getitem, (node, i))
                item_node.meta["val"] = item
                _bind(builder, item_node, item)


def _subgraph(builder: Builder, prefix: str, gm: fx.GraphModule) -> fx.Node:
    n = 0
    while f"{prefix}_{n}" in builder.submodules:
        n += 1
    builder.submodules[f"{prefix}_{n}"] = gm
    return builder.graph.get_attr(f"{prefix}_{n}")


def _loop_outputs(body: BranchBuilder, carried: tuple) -> tuple:
    """A while_loop's outputs in a static capture: like its carried inputs, which its body must keep."""
    returned = [n.meta.get("val") for n in body.graph.find_nodes(op="output")[0].args[0]]
    if len(returned) != len(carried):
        raise _unsupported(f"the body of while_loop returns {len(returned)} values for {len(carried)} carried")
    for before, after in zip(carried, returned, strict=True):
        if (tuple(before.shape), before.dtype) != (tuple(after.shape), after.dtype):
            raise _unsupported(
                f"the body of while_loop turns a carried {before.dtype} {tuple(before.shape)} into a "
                f"{after.dtype} {tuple(after.shape)} (carried values must keep their shape and dtype)")
    return tuple(_fresh(t) for t in carried)


def _run_on_fakes(tracer: Tracer, func: Any, full: list[Any], kwargs: dict) -> tuple:
    """The op's outputs (fakes), from torch's own fake implementation with the traced subgraphs."""
    fake_args = map_tensors(full, tracer.fake_of)
    grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in pytree.tree_leaves(fake_args) if isinstance(t, torch.Tensor))
    with DisableTorchFunction(), torch.no_grad():
        try:
            out = func(*fake_args, **kwargs)
        except CaptureError:
            raise
        except Exception as error:  # torch's checks on the functions (branches that disagree) and its limits
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise CaptureError(message(
                f"{func.__name__} cannot be captured: {type(error).__name__}: {first}", user_location(),
                f"make the functions of {func.__name__} meet torch's rules for it "
                "(same output shapes and dtypes, no aliasing of inputs)",
            )) from error
    out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if not grad:
        return out

    def differentiable(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
            return t.detach().requires_grad_(True).clone()
        return t

    with DisableTorchFunction():
        return pytree.tree_map(differentiable, out)
