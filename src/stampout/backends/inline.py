"""Region calls inlined: the outer graph with each invoke_subgraph replaced by a copy of its subgraph's nodes.

For graphs AOTAutograd cannot take with region calls in them, while it takes the same ops in a flat graph
(the values are the same, only the body is no longer shared):

# Note: tensor-subclass operands
torch 2.13's invoke_subgraph refuses tensor subclass operands (a DTensor parameter of a tensor-parallel layer:
"aten.mm.default got mixed torch.Tensor and DTensor"); in a flat graph they are desugared to local tensors and
collectives.

# Note: custom ops that write an argument
torch 2.13 functionalizes an invoke_subgraph body with a FunctionalTensorMode that refuses a custom (non-aten)
op writing one of its arguments (`Tensor! out`: "Found a custom (non-ATen) operator whose output has alias
annotations"); the same op in a flat graph is auto-functionalized.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..torch_internals import INVOKE_SUBGRAPH
from .split import region_calls


def subclass_operands(gm: fx.GraphModule) -> str | None:
    """The first region call with a tensor-subclass operand (its name and the subclass), or None."""
    for call in region_calls(gm):
        for operand in call.operands:
            value = operand.meta.get("val") if isinstance(operand, fx.Node) else None
            if is_traceable_wrapper_subclass(value):
                return f"{call.node.args[1]} gets a {type(value).__name__} ({operand.name})"
    return None


def reason_to_inline(gm: fx.GraphModule) -> str | None:
    """Why AOTAutograd cannot take `gm`'s region calls (the first region found, see the Notes), or None."""
    why = subclass_operands(gm)
    if why is not None:
        return why
    for call in region_calls(gm):
        written = _custom_op_writing(getattr(gm, call.node.args[0].target))
        if written is not None:
            return f"{call.node.args[1]} calls {written}, a custom op that writes an argument"
    return None


def _custom_op_writing(gm: fx.GraphModule) -> str | None:
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                if node.op == "call_function" and _writes(node.target):
                    return str(node.target)
    return None


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


def inline_regions(gm: fx.GraphModule, prefix: str = "") -> fx.GraphModule:
    """A copy of `gm` without region calls: each replaced by its subgraph's nodes (nested ones too). The
    attributes its nodes read are named `prefix` + their name (the subgraphs' own under their call's name)."""
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    attrs: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            if isinstance(value, fx.GraphModule) and all(u.target is INVOKE_SUBGRAPH for u in node.users):
                continue  # a region subgraph: its nodes are copied where it is called
        if node.op == "call_function" and node.target is INVOKE_SUBGRAPH:
            sub = inline_regions(getattr(gm, node.args[0].target), f"{prefix}{node.name}_")
            attrs.update({n.target: getattr(sub, n.target) for n in sub.graph.nodes if n.op == "get_attr"})
            placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
            values = {p: env[a] if isinstance(a, fx.Node) else a for p, a in zip(placeholders, node.args[2:])}
            env[node] = graph.graph_copy(sub.graph, values)
            continue
        if (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node)
                and node.args[0].target is INVOKE_SUBGRAPH):
            env[node] = env[node.args[0]][node.args[1]]
            continue
        new = graph.node_copy(node, lambda n: env[n])
        new.meta = dict(node.meta)
        if node.op == "get_attr":
            new.target = f"{prefix}{node.target}"
            attrs[new.target] = getattr(gm, node.target)
        env[node] = new
    return fx.GraphModule(attrs, graph, class_name=type(gm).__name__)
