"""Region calls that differ in which operands require grad, given identifiers of their own before AOTAutograd.

# Note: torch keys a region's autograd by its identifier only
torch 2.13's invoke_subgraph keeps, per identifier, the autograd function of the first call it traced (with the
first call's output metadata: which outputs get no gradient) and the lazily traced backward of the first call
whose backward runs (keyed by identifier and tangent metadata, not by which primals require grad). The backward
runs last call first: when the last call of a region has frozen parameters (`requires_grad_(False)`), its
backward, which computes no parameter gradient, is traced first and reused for every other call, and every
layer loses its parameter gradients, silently. Which operands require grad is as much a part of a call's
identity as the subgraph, so calls that differ in it from the subgraph's trace get an identifier per pattern
here (the others keep the captured name), and a copy of the subgraph whose outputs' traced values are left out
(torch reads which outputs require grad from them). The pattern is read from the operands' captured values
(`meta["val"]`), which the compiled call's guards hold (an entry is keyed by which inputs require grad and its
tensor guards check the parameters' requires_grad).
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from ..torch_internals import INVOKE_SUBGRAPH, without_module_hooks

log = logging.getLogger(__name__)


def _requires_grad(node: Any) -> bool | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value.requires_grad if isinstance(value, torch.Tensor) else None


def _fresh(gm: fx.GraphModule, taken: set[str], base: str) -> str:
    n = 1
    while f"{base}_grad_{n}" in taken or hasattr(gm, f"{base}_grad_{n}"):
        n += 1
    taken.add(f"{base}_grad_{n}")
    return f"{base}_grad_{n}"


def _copy_without_output_metadata(sub: fx.GraphModule) -> fx.GraphModule:
    """`sub` with the values of its outputs left out: torch then finds which outputs require grad by running it on
    the call's operands (its `get_output_metadata`), not from the trace of a call with another pattern."""
    graph = fx.Graph()
    out, _ = graph.graph_copy(sub.graph, {}, return_output_node=True)
    output = graph.output(out)
    for arg in output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],):
        if isinstance(arg, fx.Node):
            arg.meta.pop("val", None)  # (graph_copy copies each node's meta dict: the original keeps its own)
    return without_module_hooks(fx.GraphModule(sub, graph))


def _outputs_require_grad(call: fx.Node, traced: tuple) -> tuple:
    """Which outputs of a region call require grad, by the values of its getitem users (an unused output: as
    traced)."""
    seen = {u.args[1]: _requires_grad(u) for u in call.users if u.target is operator.getitem}
    return tuple(seen.get(i, t) if seen.get(i) is not None else t for i, t in enumerate(traced))


def separate_by_requires_grad(gm: fx.GraphModule) -> int:
    """Give the region calls of `gm` whose operands or outputs differ from their subgraph's trace in requiring
    grad an identifier per pattern, and a copy of the subgraph without its outputs' traced values; returns how
    many calls were changed. (Nested region calls keep theirs: their operands' patterns are those of the one
    trace of the enclosing subgraph.)"""
    calls = gm.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH)
    taken = {node.args[1] for node in calls}
    separated: dict[tuple, str] = {}  # (subgraph attr, operands' pattern, outputs' pattern) -> identifier
    changed = 0
    for node in calls:
        attr, name = node.args[0], node.args[1]
        sub = getattr(gm, attr.target, None) if attr.op == "get_attr" else None
        if not isinstance(sub, fx.GraphModule):
            continue
        traced_in = tuple(_requires_grad(p) for p in sub.graph.find_nodes(op="placeholder"))
        output = sub.graph.find_nodes(op="output")[0].args[0]
        traced_out = tuple(_requires_grad(o) for o in (output if isinstance(output, (tuple, list)) else (output,)))
        pattern = (tuple(_requires_grad(a) for a in node.args[2:]), _outputs_require_grad(node, traced_out))
        if pattern == (traced_in, traced_out):
            continue
        key = (attr.target, *pattern)
        if key not in separated:
            separated[key] = _fresh(gm, taken, name)
            gm.add_submodule(separated[key], _copy_without_output_metadata(sub))
        with gm.graph.inserting_before(node):
            new_attr = gm.graph.get_attr(separated[key])
        node.args = (new_attr, separated[key], *node.args[2:])
        changed += 1
    if changed:
        gm.graph.eliminate_dead_code()  # (get_attr nodes no call uses any more)
        log.info("%d region calls get an identifier of their own: they differ in requiring grad from their "
                 "subgraph's trace", changed)
        gm.recompile()
    return changed
