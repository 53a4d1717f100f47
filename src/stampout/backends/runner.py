"""Running a captured graph eagerly, training included.

Backward through `invoke_subgraph` fails in plain eager on torch 2.13, so the runner calls each
region's subgraph module directly (`call_module`), recursively for nested regions.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..torch_internals import INVOKE_SUBGRAPH, without_module_hooks


def as_call_modules(gm: fx.GraphModule, memo: dict[int, fx.GraphModule] | None = None) -> fx.GraphModule:
    """A copy of `gm` whose invoke_subgraph calls are plain `call_module` calls of the subgraphs."""
    memo = {} if memo is None else memo
    if id(gm) in memo:
        return memo[id(gm)]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    modules: dict[str, torch.nn.Module] = {}
    for node in gm.graph.nodes:
        sub = getattr(gm, node.target, None) if node.op == "get_attr" else None
        if isinstance(sub, fx.GraphModule) and all(user.target is INVOKE_SUBGRAPH for user in node.users):
            continue  # the subgraph is called by name below
        if node.op == "call_function" and node.target is INVOKE_SUBGRAPH:
            name = node.args[0].target
            modules[name] = as_call_modules(getattr(gm, name), memo)
            operands = tuple(env[a] if isinstance(a, fx.Node) else a for a in node.args[2:])
            new = graph.call_module(name, operands)
        else:
            new = graph.node_copy(node, lambda n: env[n])
            if node.op == "get_attr":  # a constant, or a function of a higher-order op (torch.cond's branches)
                modules[node.target] = as_call_modules(sub, memo) if isinstance(sub, fx.GraphModule) else sub
        new.meta = dict(node.meta)
        env[node] = new
    out = without_module_hooks(fx.GraphModule(modules, graph, class_name=type(gm).__name__))
    memo[id(gm)] = out
    return out

