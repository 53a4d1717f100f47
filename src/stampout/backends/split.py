"""Compile each distinct region on its own; run the outer graph (the glue) eagerly around them.

In a model built from repeated blocks nearly all the work is inside the regions; the glue is an embedding,
rotary tables, a final norm, a head. Compiling the glue as well costs an AOTAutograd trace and an Inductor
lowering of an outer graph with one invoke_subgraph per layer, C++ kernels for ops that run once per call,
and a cache key that changes with depth. So when the glue is thin, stampout compiles each distinct region
subgraph as a graph of its own (forward and backward, through AOTAutograd, so training works), and runs the
glue as an FX GraphModule whose region calls call the compiled regions. A region's compiled code is found
again in Inductor's caches by the region alone, whatever the model's depth, and in-process it is shared by
every later capture that stamps out the same subgraph.

`reason_to_compile_whole(gm)` says why a graph must instead go to Inductor whole (global state changed
around region calls, operands that alias or are not static tensors, regions that mutate their inputs, a
glue that does real work); `build(gm, compile_region)` makes the eager glue.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .. import caches, config
from ..torch_internals import (
    INVOKE_SUBGRAPH,
    FakeTensor,
    enter_autocast,
    exit_autocast,
    pytree,
    set_grad_enabled,
    without_module_hooks,
)
from ..trace.op_facts import may_alias, written
from ..trace.op_facts import writes_in_place as writes_in_place_op
from ..trace.shapes import has_symbols, size_key, sizes_key
from . import progress

_SET_GRAD = set_grad_enabled
_AUTOCAST = (enter_autocast, exit_autocast)


@dataclass(frozen=True)
class RegionCall:
    """One invoke_subgraph node of the outer graph, with the grad mode it runs under and whether the outer
    graph has entered autocast around it."""

    node: fx.Node
    subgraph: fx.GraphModule
    grad_enabled: bool
    in_autocast: bool = False

    @property
    def operands(self) -> tuple[Any, ...]:
        return tuple(self.node.args[2:])


def region_calls(gm: fx.GraphModule) -> list[RegionCall]:
    """The outer graph's region calls, following its grad mode (`torch._C._set_grad_enabled` nodes, from the
    current mode) and autocast sections (`_enter_autocast` ... `_exit_autocast`)."""
    grad = torch.is_grad_enabled()
    autocast = 0
    calls = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _SET_GRAD and isinstance(node.args[0], bool):
            grad = node.args[0]
        elif node.target in _AUTOCAST:
            autocast += 1 if node.target is _AUTOCAST[0] else -1
        elif node.target is INVOKE_SUBGRAPH:
            calls.append(RegionCall(node, getattr(gm, node.args[0].target), grad, autocast > 0))
    return calls


def compute_nodes(gm: fx.GraphModule) -> int:
    return sum(n.op in ("call_function", "call_method", "call_module") and n.target is not operator.getitem
               for n in gm.graph.nodes)


def writes_in_place(node: fx.Node) -> bool:
    """Whether a node may write into an existing tensor (op_facts.writes_in_place of its call)."""
    return node.op in ("call_function", "call_method") and writes_in_place_op(node.target, node.args, node.kwargs)


def _may_be_an_input(value: Any) -> bool:
    """Whether a subgraph value may share memory with one of its inputs: reachable from a placeholder
    through view-like ops only (syntactic and conservative: captured metadata does not record aliasing)."""
    if not isinstance(value, fx.Node):
        return False
    if value.op == "placeholder" or value.op not in ("call_function", "call_method"):
        return True
    arguments = pytree.tree_leaves((value.args, value.kwargs))
    return may_alias(value.target) and any(_may_be_an_input(a) for a in arguments)


def may_alias_an_input(sub: fx.GraphModule) -> bool:
    """Whether an output of the subgraph may be (a view of) an input."""
    return any(_may_be_an_input(out) for out in pytree.tree_leaves(sub.graph.output_node().args[0]))


def writes_an_input(sub: fx.GraphModule) -> bool:
    """Whether the subgraph may write into one of its inputs (writes into tensors it made are fine)."""
    for node in sub.graph.nodes:
        if writes_in_place(node):
            into = written(node.target, node.args, node.kwargs)
            if not into or any(_may_be_an_input(w) for w in into):
                return True
    return False


def _bases(value: Any) -> set[fx.Node]:
    """The nodes whose memory `value` may share (itself, or what it is a view of, syntactically)."""
    if not isinstance(value, fx.Node) or value.op not in ("call_function", "call_method"):
        return {value} if isinstance(value, fx.Node) else set()
    if not may_alias(value.target):
        return {value}
    return {base for a in pytree.tree_leaves((value.args, value.kwargs)) for base in _bases(a)}


def _separate_and_constant(call: RegionCall) -> bool:
    """No two tensor operands may share memory (by the graph's view ops, and by the capture's fakes of its
    inputs), and none requires grad where grad is enabled."""
    from torch.multiprocessing.reductions import StorageWeakRef

    operands = [o for o in call.operands if isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor)]
    tensors = [o.meta["val"] for o in operands]
    if call.grad_enabled and any(t.requires_grad for t in tensors):
        return False
    seen: set[fx.Node] = set()
    for operand in operands:
        bases = _bases(operand)
        if bases & seen:
            return False
        seen |= bases
    return len({StorageWeakRef(t.untyped_storage()) for t in tensors}) == len(tensors)


def _operand_ok(value: Any) -> bool:
    """A tensor (sizes static, or symbols of the capture), or a size passed as an int (a bound symbol)."""
    return isinstance(value, (FakeTensor, torch.SymInt, int)) and not isinstance(value, bool)


def symbolic(values: list[Any]) -> bool:
    return any(isinstance(v, torch.SymInt) or has_symbols(v) for v in values)


def trains(example_inputs: list[Any]) -> bool:
    """Whether a graph with these inputs is compiled for training (grad on, an input that requires grad)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


def reason_to_compile_whole(gm: fx.GraphModule, max_glue: float | None = None) -> str | None:
    """None when each region may be compiled on its own with eager glue; else why not. The glue may do at
    most `max_glue` (default `config.thin_glue`) times the regions' work (in graph nodes). Measured here, a
    decoder's eager glue calling regions compiled with the C++ wrapper runs no slower than torch.compile's whole
    graph."""
    max_glue = config.thin_glue if max_glue is None else max_glue
    calls = region_calls(gm)
    if not calls:
        return "no region calls"
    for call in calls:
        if call.in_autocast:
            return f"{call.node.name} runs inside an autocast section of the outer graph"
        for operand in call.operands:
            value = operand.meta.get("val") if isinstance(operand, fx.Node) else operand
            if not _operand_ok(value):
                return f"{call.node.name} has an operand that is neither a tensor nor a size"
        # Compiled apart, a region's example inputs are fresh tensors: AOTAutograd would not know which of
        # them alias, which matters only when an input is written in place (a static KV cache's index_copy_):
        # fine when no two operands share memory and none requires grad.
        if writes_an_input(call.subgraph) and not _separate_and_constant(call):
            return f"{call.node.args[1]} may write into its inputs, which share memory or require grad"
    region_work = sum(compute_nodes(call.subgraph) for call in calls)
    glue_work = compute_nodes(gm) - len(calls)
    if glue_work > max_glue * region_work:
        return f"the glue does real work ({glue_work} nodes beside {region_work} in regions)"
    return None


def metadata(value: Any) -> tuple:
    if not isinstance(value, torch.Tensor):  # a bound symbol (or a size specialized to an int)
        return ("size", size_key(value))
    return (sizes_key(value.shape), sizes_key(value.stride()), size_key(value.storage_offset()), value.dtype,
            value.device, value.requires_grad, value.layout)


def example_like(value: FakeTensor, fake_mode: Any) -> torch.Tensor:
    """A tensor of `fake_mode` with `value`'s metadata (what AOTAutograd would make of a real input)."""
    with fake_mode:
        if value.storage_offset():
            base = torch.empty(value.untyped_storage().nbytes() // value.element_size(), dtype=value.dtype,
                               device=value.device)
            out = base.as_strided(value.shape, value.stride(), value.storage_offset())
        else:
            out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    return out.requires_grad_(value.requires_grad)


class CompiledRegion(torch.nn.Module):
    """A compiled region in the glue graph (a module, so the glue's code can call it by name)."""

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        super().__init__()
        self.fn = fn
        self.region = name

    def forward(self, *operands: Any) -> Any:
        return self.fn(*operands)

    def __call__(self, *operands: Any) -> Any:  # (no nn.Module hooks: the user's global ones are for theirs)
        return self.fn(*operands)


def relayout(tensor: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """`tensor`'s values in a new tensor with `stride` (differentiable: a copy)."""
    if tensor.stride() == tuple(stride):
        return tensor
    out = torch.empty_strided(tensor.shape, stride, dtype=tensor.dtype, device=tensor.device)
    return out.copy_(tensor)


def _code(sub: fx.GraphModule) -> str | None:
    """The subgraph's code with its nested subgraphs' (None if it reads other attributes, whose values the
    code does not show)."""
    parts = [sub.code]
    for node in sub.graph.nodes:
        if node.op == "get_attr":
            value = getattr(sub, node.target)
            inner = _code(value) if isinstance(value, fx.GraphModule) else None
            if inner is None:
                return None
            parts.append(inner)
    return "\n".join(parts)


def _output_values(sub: fx.GraphModule) -> list[Any]:
    return [n.meta.get("val") if isinstance(n, fx.Node) else n
            for n in pytree.tree_leaves(sub.graph.output_node().args[0])]


@dataclass
class Plan:
    """How a region call is served: the call whose subgraph and operand layout are compiled, and the
    operands that must be copied into that layout first (their stride, else None)."""

    compiled_as: RegionCall
    relayout: tuple[tuple[int, ...] | None, ...]


def plan(calls: list[RegionCall]) -> dict[fx.Node, Plan]:
    """One compile per (subgraph, operand metadata, grad mode) — and one for subgraphs that differ only in
    their operands' strides (same code, e.g. a first block fed a transposed activation): the layout most
    calls use is compiled and the others' operands are copied into it, when no output may alias an input
    and the outputs' layouts agree."""
    def exact(call: RegionCall) -> tuple:
        return (id(call.subgraph), tuple(metadata(o.meta["val"]) for o in call.operands), call.grad_enabled)

    def loose(call: RegionCall) -> tuple | None:
        code = _code(call.subgraph)
        if code is None or may_alias_an_input(call.subgraph) or symbolic([o.meta["val"] for o in call.operands]):
            return None
        values = _output_values(call.subgraph)
        if not all(isinstance(v, FakeTensor) for v in values):
            return None
        outputs = tuple((tuple(v.shape), v.stride(), v.dtype) for v in values)
        operands = tuple(metadata(o.meta["val"])[3:] + (tuple(o.meta["val"].shape),) for o in call.operands)
        return (code, operands, outputs, call.grad_enabled)

    by_exact: dict[tuple, list[RegionCall]] = {}
    for call in calls:
        by_exact.setdefault(exact(call), []).append(call)
    plans = {call.node: Plan(group[0], (None,) * len(call.operands)) for group in by_exact.values() for call in group}
    by_loose: dict[tuple, list[list[RegionCall]]] = {}
    for group in by_exact.values():
        key = loose(group[0])
        if key is not None:
            by_loose.setdefault(key, []).append(group)
    for groups in by_loose.values():
        main = max(groups, key=len)[0]
        main_vals = [o.meta["val"] for o in main.operands]
        for group in groups:
            vals = [o.meta["val"] for o in group[0].operands]
            strides = tuple(None if (v.stride(), v.storage_offset()) == (m.stride(), m.storage_offset()) else m.stride()
                            for v, m in zip(vals, main_vals))
            if any(s is not None and m.storage_offset() for s, m in zip(strides, main_vals)):
                continue
            for call in group:
                plans[call.node] = Plan(main, strides)
    return plans


# subgraph module -> {(operand metadata, grad mode, key extra): compiled}; dropped with the subgraph.
_COMPILED: weakref.WeakKeyDictionary = caches.register(weakref.WeakKeyDictionary(), "backends.split compiled regions")

CompileRegion = Callable[[RegionCall, list[FakeTensor]], Callable[..., Any]]


def build(gm: fx.GraphModule, compile_region: CompileRegion, key_extra: Any = None,
          ahead: Callable[[list[RegionCall]], None] | None = None) -> fx.GraphModule:
    """The glue: `gm` with each region call replaced by a call of its compiled region (see `plan`). Each
    compile is done once per process; `key_extra` names whatever else it depends on (config). `ahead` is told,
    before the first compile, which calls will be compiled, in the order they will be."""
    calls = region_calls(gm)
    plans = plan(calls)

    def key_of(call: RegionCall) -> tuple:
        vals = [operand.meta["val"] for operand in call.operands]
        return tuple(metadata(v) for v in vals), call.grad_enabled, key_extra

    todo: dict[tuple, RegionCall] = {}
    for call in calls:
        compiled_as = plans[call.node].compiled_as
        key = key_of(compiled_as)
        if key not in _COMPILED.get(compiled_as.subgraph, {}):
            todo.setdefault((id(compiled_as.subgraph), key), compiled_as)
    progress.expect(len(todo))
    if ahead is not None:
        ahead(list(todo.values()))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    modules: dict[str, torch.nn.Module] = {}
    names: dict[int, str] = {}
    for node in gm.graph.nodes:
        target = getattr(gm, node.target, None) if node.op == "get_attr" else None
        if isinstance(target, fx.GraphModule):
            continue  # a region subgraph: called through its compiled module below
        if node not in plans:
            new = graph.node_copy(node, lambda n: env[n])
            if node.op == "get_attr":
                modules[node.target] = target
        else:
            compiled_as = plans[node].compiled_as
            vals = [operand.meta["val"] for operand in compiled_as.operands]
            key = key_of(compiled_as)
            compiled = _COMPILED.setdefault(compiled_as.subgraph, {})
            if key not in compiled:
                with torch.set_grad_enabled(compiled_as.grad_enabled):
                    compiled[key] = compile_region(compiled_as, vals)
            fn = compiled[key]
            if id(fn) not in names:
                names[id(fn)] = f"compiled_{compiled_as.node.args[1]}_{len(names)}"
                modules[names[id(fn)]] = CompiledRegion(fn, compiled_as.node.args[1])
            operands = [env[a] for a in node.args[2:]]
            operands = [a if stride is None else graph.call_function(relayout, (a, stride))
                        for a, stride in zip(operands, plans[node].relayout)]
            new = graph.call_module(names[id(fn)], tuple(operands))
        new.meta = dict(node.meta)
        env[node] = new
    return without_module_hooks(fx.GraphModule(modules, graph, class_name="Glue"))
