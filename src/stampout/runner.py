"""Running a captured graph eagerly, training included.

Backward through `invoke_subgraph` fails in plain eager on torch 2.13, so the runner calls each
region's subgraph module directly (`call_module`), recursively for nested regions.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .torch_internals import INVOKE_SUBGRAPH


def as_call_modules(gm: fx.GraphModule, memo: dict[int, fx.GraphModule] | None = None) -> fx.GraphModule:
    """A copy of `gm` whose invoke_subgraph calls are plain `call_module` calls of the subgraphs."""
    memo = {} if memo is None else memo
    if id(gm) in memo:
        return memo[id(gm)]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    modules: dict[str, torch.nn.Module] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(gm, node.target, None), fx.GraphModule):
            continue  # the subgraph is called by name below
        if node.op == "call_function" and node.target is INVOKE_SUBGRAPH:
            name = node.args[0].target
            modules[name] = as_call_modules(getattr(gm, name), memo)
            operands = tuple(env[a] if isinstance(a, fx.Node) else a for a in node.args[2:])
            new = graph.call_module(name, operands)
        else:
            new = graph.node_copy(node, lambda n: env[n])
            if node.op == "get_attr":
                modules[node.target] = getattr(gm, node.target)
        new.meta = dict(node.meta)
        env[node] = new
    out = fx.GraphModule(modules, graph, class_name=type(gm).__name__)
    memo[id(gm)] = out
    return out


def inline_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """A flat copy of `gm`: every region call replaced by the body of its subgraph (recursively)."""
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    modules: dict[str, torch.nn.Module] = {}
    _inline_into(graph, gm, env, modules, None)
    return fx.GraphModule(modules, graph, class_name=type(gm).__name__)


def _inline_into(graph: fx.Graph, gm: fx.GraphModule, env: dict[fx.Node, Any], modules: dict,
                 operands: list[Any] | None) -> list[Any] | None:
    """Copy `gm`'s nodes into `graph` (placeholders bound to `operands` when inlining a subgraph); returns
    the values of its outputs."""
    placeholders = iter(operands or ())
    results: dict[fx.Node, list[Any]] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and operands is not None:
            env[node] = next(placeholders)
        elif node.op == "get_attr" and isinstance(getattr(gm, node.target, None), fx.GraphModule):
            continue
        elif node.op == "call_function" and node.target is INVOKE_SUBGRAPH:
            inner = getattr(gm, node.args[0].target)
            args = [env[a] if isinstance(a, fx.Node) else a for a in node.args[2:]]
            results[node] = _inline_into(graph, inner, {}, modules, args)
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in results:
            env[node] = results[node.args[0]][node.args[1]]
        elif node.op == "output":
            values = [env[a] if isinstance(a, fx.Node) else a for a in node.args[0]]
            if operands is not None:
                return values
            out = graph.output(tuple(values))
            out.meta = dict(node.meta)
        else:
            if node.op == "get_attr":
                name = f"{id(gm):x}_{node.target}" if operands is not None else node.target
                modules[name] = getattr(gm, node.target)
                new = graph.get_attr(name)
            else:
                new = graph.node_copy(node, lambda n: env[n])
            new.meta = dict(node.meta)
            env[node] = new
    return None
