"""Region calls that AOTAutograd cannot functionalize as invoke_subgraph, inlined into the calling graph.

# Note: custom ops that write an argument
torch 2.13 functionalizes an invoke_subgraph body with a FunctionalTensorMode that refuses a custom (non-aten)
op writing one of its arguments (`Tensor! out`: "Found a custom (non-ATen) operator whose output has alias
annotations"); the same op in a flat graph is auto-functionalized. The calls of such regions are inlined
before AOTAutograd: the same values, only the body is no longer shared.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ..torch_internals import INVOKE_SUBGRAPH


def _writes_through_custom_op(gm: fx.GraphModule) -> bool:
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        if any(node.op == "call_function" and _writes(node.target) for node in module.graph.nodes):
            return True
    return False


def _writes(target: Any) -> bool:
    """A custom op (any overload, for a packet) whose schema writes one of its arguments."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        overloads = [getattr(target, name) for name in target.overloads()]
    elif isinstance(target, torch._ops.OpOverload):
        overloads = [target]
    else:
        return False
    return any(op.namespace not in ("aten", "prims")
               and any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)
               for op in overloads)


def inline_unfunctionalizable(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm`, or a copy whose calls of regions holding a custom op that writes an argument are inlined."""
    calls = gm.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH)
    if not any(_writes_through_custom_op(getattr(gm, n.args[0].target)) for n in calls):
        return gm
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    attrs: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is INVOKE_SUBGRAPH:
            sub = getattr(gm, node.args[0].target)
            operands = [env[a] if isinstance(a, fx.Node) else a for a in node.args[2:]]
            if _writes_through_custom_op(sub):
                env[node] = _inline(graph, inline_unfunctionalizable(sub), operands, attrs, f"{node.name}_")
                continue
        if (node.op == "call_function" and node.target is operator.getitem
                and isinstance(env.get(node.args[0]), tuple)):
            env[node] = env[node.args[0]][node.args[1]]
            continue
        if node.op == "get_attr":
            attrs[node.target] = getattr(gm, node.target)
        new = graph.node_copy(node, lambda n: env[n])
        new.meta = dict(node.meta)
        env[node] = new
    return fx.GraphModule(attrs, graph, class_name=type(gm).__name__)


def _inline(graph: fx.Graph, sub: fx.GraphModule, operands: list[Any], attrs: dict[str, Any],
            prefix: str) -> tuple:
    """Copy `sub`'s body into `graph` with its placeholders bound to `operands`; its outputs, as a tuple."""
    env: dict[fx.Node, Any] = {}
    placeholders = iter(operands)
    for node in sub.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders)
        elif node.op == "output":
            return tuple(env[a] if isinstance(a, fx.Node) else a for a in node.args[0])
        elif node.op == "get_attr":
            attrs[prefix + node.target] = getattr(sub, node.target)
            env[node] = graph.get_attr(prefix + node.target)
        else:
            new = graph.node_copy(node, lambda n: env[n])
            new.meta = dict(node.meta)
            env[node] = new
    raise AssertionError("a subgraph without an output")
