"""Region calls that AOTAutograd cannot differentiate, inlined into the graph that calls them.

torch 2.13's invoke_subgraph refuses training through a subgraph that writes its inputs in place ("does not
currently support training with in-place input or buffer mutations": BatchNorm's running stats in a ResNet
stage). Before an AOTAutograd backend sees a graph whose inputs need gradients, each such region call is
replaced by the subgraph's nodes (nested region calls inside it come along, and are inlined too if they write
their inputs); the other region calls stay shared subgraphs.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from ..torch_internals import INVOKE_SUBGRAPH
from .split import writes_an_input

log = logging.getLogger(__name__)


def _trains(example_inputs: list[Any]) -> bool:
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in example_inputs)


def _writes(sub: fx.GraphModule) -> bool:
    """Whether a subgraph writes its inputs, itself or through a region call nested in it (conservatively)."""
    return writes_an_input(sub) or any(_writes(getattr(sub, node.args[0].target))
                                       for node in sub.graph.nodes if node.target is INVOKE_SUBGRAPH)


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


def inline_writing_regions(gm: fx.GraphModule, example_inputs: list[Any]) -> int:
    """Inline, when the graph trains, every region call whose subgraph writes its inputs; how many were."""
    if not _trains(example_inputs):
        return 0
    inlined = 0
    skipped: set[fx.Node] = set()
    while True:
        call = next((node for node in gm.graph.nodes if node.target is INVOKE_SUBGRAPH and node not in skipped
                     and _writes(getattr(gm, node.args[0].target))), None)
        if call is None:
            break
        if _inline(gm, call):
            inlined += 1
        else:
            skipped.add(call)
    if inlined:
        gm.graph.lint()
        gm.recompile()
        log.info("inlined %d region calls that write their inputs (torch cannot train through them as subgraphs)",
                 inlined)
    return inlined
