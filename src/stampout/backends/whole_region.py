"""A graph that is one region call: its subgraph is what a backend compiles.

# Note: why compile the subgraph itself
A sharded block of an FSDP stack is compiled as a piece of its own (sharded.py), and its graph is a single
region call: placeholders passed to `invoke_subgraph` of the stamped subgraph, its outputs returned in order.
Through AOTAutograd the higher-order op costs more than the block's ops (its schema is traced, its body
functionalized as a subgraph, and its backward traced again at the first backward); the subgraph compiled as
the graph computes the same thing, with the placeholders handed to it in the region call's order. Its compile
serves every block whose piece calls the same subgraph with inputs of the same metadata (aot_eager.py keys it).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from ..torch_internals import INVOKE_SUBGRAPH


@dataclass(frozen=True)
class WholeRegion:
    """`gm` is `subgraph(*[inputs[i] for i in order])`."""

    subgraph: fx.GraphModule
    order: tuple[int, ...]

    def inputs(self, inputs: list[Any]) -> list[Any]:
        return [inputs[i] for i in self.order]

    def wrap(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        order = self.order

        def run(*inputs: Any) -> Any:
            return compiled(*[inputs[i] for i in order])

        return run


def whole_region(gm: fx.GraphModule) -> WholeRegion | None:
    """The region call `gm` is nothing but (placeholders in, its outputs out in order), or None."""
    placeholders: dict[fx.Node, int] = {}
    call = None
    items: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            placeholders[node] = len(placeholders)
        elif node.op == "get_attr":
            if not isinstance(getattr(gm, node.target, None), fx.GraphModule) or len(node.users) != 1:
                return None
        elif node.op == "call_function" and node.target is INVOKE_SUBGRAPH and call is None:
            call = node
        elif (node.op == "call_function" and node.target is operator.getitem and node.args[0] is call
              and call is not None and type(node.args[1]) is int):
            items[node] = node.args[1]
        elif node.op == "output":
            returned = node.args[0]
        else:
            return None
    if call is None or not all(isinstance(a, fx.Node) and a in placeholders for a in call.args[2:]):
        return None
    subgraph = getattr(gm, call.args[0].target)
    outputs = next(n for n in reversed(subgraph.graph.nodes) if n.op == "output").args[0]
    if (not isinstance(returned, (tuple, list)) or not isinstance(outputs, (tuple, list))
            or [items.get(n) for n in returned] != list(range(len(outputs)))):
        return None
    return WholeRegion(subgraph, tuple(placeholders[a] for a in call.args[2:]))
