"""Region calls inlined: a region call replaced by a copy of its subgraph's nodes, for graphs AOTAutograd takes
flat but not with region calls in them (the values are the same; only the body is no longer shared).

# Note: tensor-subclass operands
torch 2.13's invoke_subgraph refuses tensor subclass operands (a DTensor parameter of a tensor-parallel layer:
"aten.mm.default got mixed torch.Tensor and DTensor"); in a flat graph they are desugared to local tensors and
collectives. Every region call of such a graph is inlined (`inline_regions`).

# Note: subgraphs that write
torch 2.13 refuses training through a subgraph that writes its inputs in place ("does not currently support
training with in-place input or buffer mutations": BatchNorm's running stats in a ResNet stage), and it
functionalizes a subgraph with a FunctionalTensorMode that refuses a custom (non-aten) op writing one of its
arguments (`Tensor! out`: "Found a custom (non-ATen) operator whose output has alias annotations"), while the same
ops in a flat graph are functionalized. Only those region calls are inlined (`inline_writing_regions`), nested
ones with them; the others stay shared subgraphs.

# Note: writes into inputs at run time
A region call that writes its inputs (a static KV cache's index_copy_) reaches AOTAutograd as an invoke_subgraph
with mutated operands, which it functionalizes into `auto_functionalized_v2`: at every call it walks the operands,
clones each written base and copies the result back, in Python (1.8x torch.compile's time per token under
aot_eager, 16-layer Llama, static cache). Inlined, the write is a plain op on the graph input, as in torch.compile's
flat graph. aot_eager inlines them (`inputs_too`); Inductor compiles such regions apart, where the write is an
input mutation of the region's own graph that it performs in place (split.py).
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch.fx as fx

from ..torch_internals import INVOKE_SUBGRAPH, is_traceable_wrapper_subclass
from ..trace.op_facts import custom_op_writes
from .split import region_calls, trains, writes_an_input

log = logging.getLogger(__name__)


def subclass_operands(gm: fx.GraphModule) -> str | None:
    """The first region call with a tensor-subclass operand (its name and the subclass), or None."""
    for call in region_calls(gm):
        for operand in call.operands:
            value = operand.meta.get("val") if isinstance(operand, fx.Node) else None
            if is_traceable_wrapper_subclass(value):
                return f"{call.node.args[1]} gets a {type(value).__name__} ({operand.name})"
    return None


def _custom_op_writing(gm: fx.GraphModule) -> str | None:
    """The first custom op in `gm` (or the graphs it holds) whose schema writes one of its arguments, or None."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                if node.op == "call_function" and custom_op_writes(node.target):
                    return str(node.target)
    return None


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


def _writes(sub: fx.GraphModule, training: bool, known: dict[int, bool]) -> bool:
    """Whether a subgraph writes through a custom op, or (training) writes its inputs: itself or through a region
    call nested in it (conservatively). `known`: the verdicts so far, by subgraph (a stack calls one 80 times)."""
    verdict = known.get(id(sub))
    if verdict is None:
        verdict = known[id(sub)] = (
            _custom_op_writing(sub) is not None or (training and writes_an_input(sub))
            or any(_writes(getattr(sub, node.args[0].target), training, known)
                   for node in sub.graph.nodes if node.target is INVOKE_SUBGRAPH))
    return verdict


def _fresh_name(gm: fx.GraphModule, base: str) -> str:
    k = 0
    while hasattr(gm, f"{base}_inlined_{k}"):
        k += 1
    return f"{base}_inlined_{k}"


def _inline(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Replace one region call by its subgraph's nodes; False where its result is used other than by item."""
    if any(user.target is not operator.getitem for user in node.users):
        return False
    sub = getattr(gm, node.args[0].target)
    env: dict[fx.Node, Any] = dict(zip(sub.graph.find_nodes(op="placeholder"), node.args[2:]))
    outputs: Any = ()
    with gm.graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outputs = fx.map_arg(n.args[0], env.__getitem__)
                break
            if n.op == "get_attr":  # a nested region's subgraph (or a constant) of the inlined one
                name = _fresh_name(gm, n.target.replace(".", "_"))
                setattr(gm, name, getattr(sub, n.target))
                env[n] = gm.graph.get_attr(name)
                env[n].meta = dict(n.meta)
            else:
                env[n] = gm.graph.node_copy(n, env.__getitem__)
    for user in list(node.users):
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    holder = node.args[0]
    gm.graph.erase_node(node)
    if not holder.users:
        gm.graph.erase_node(holder)
    return True


def inline_writing_regions(gm: fx.GraphModule, example_inputs: list[Any], inputs_too: bool = False) -> int:
    """Inline every region call whose subgraph writes through a custom op, or writes its inputs when the graph
    trains or `inputs_too` (see the Notes); how many were."""
    training = trains(example_inputs) or inputs_too
    known: dict[int, bool] = {}
    inlined = 0
    skipped: set[fx.Node] = set()
    while True:
        call = next((node for node in gm.graph.nodes if node.target is INVOKE_SUBGRAPH and node not in skipped
                     and _writes(getattr(gm, node.args[0].target), training, known)), None)
        if call is None:
            break
        if _inline(gm, call):
            inlined += 1
        else:
            skipped.add(call)
    if inlined:
        gm.graph.lint()
        gm.recompile()
        log.info("inlined %d region calls that write (torch cannot functionalize them as subgraphs)",
                 inlined)
    return inlined
