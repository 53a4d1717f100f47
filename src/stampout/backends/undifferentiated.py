"""Region call operands whose subgraph never differentiates through them, detached before AOTAutograd.

# Note: zero gradients where eager has none
torch 2.13's invoke_subgraph backward returns a gradient for every operand that requires grad, filling zeros where
the subgraph has no path from it to an output (`self.lin(x.detach())`). That zero flows on: the region call that
made the operand (the previous block) runs its backward and gives its parameters zero gradients, where eager gives
them none (`p.grad is None`, which optimizers skip: no weight decay, no momentum step). An operand no output of the
subgraph depends on differentiably is passed detached: the same values, and no gradient path, as in eager. The
analysis is conservative: only a `detach`, a result that cannot require grad (an integer or bool tensor) or one
computed with grad mode off from an input that requires grad cuts a path, and a subgraph with an in-place op (which could carry a path through a mutated tensor) is left as it is.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from ..torch_internals import INVOKE_SUBGRAPH, OpOverload

log = logging.getLogger("stampout.backends")

_DETACHES = frozenset({torch.Tensor.detach, torch.detach, torch.ops.aten.detach.default})


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _mutates(node: fx.Node) -> bool:
    target = node.target
    if node.op == "call_method":
        name = str(target)
    elif node.op == "call_function":
        if isinstance(target, OpOverload):
            return target._schema.is_mutable
        if target in (operator.setitem, setattr):
            return True
        name = getattr(target, "__name__", "")
    else:
        return node.op not in ("placeholder", "output", "get_attr")  # (a call_module: not looked into)
    return (name.endswith("_") and not name.endswith("__")) or name == "__setitem__" or "out" in node.kwargs


def _cuts(node: fx.Node, switches: bool) -> bool:
    if (node.op == "call_method" and node.target == "detach") or (node.op == "call_function"
                                                                  and node.target in _DETACHES):
        return True
    value = _val(node)
    if not isinstance(value, torch.Tensor):
        return False
    if not (value.is_floating_point() or value.is_complex()):
        return True
    # Computed with grad mode off (`with torch.no_grad():`, `set_grad_enabled(not self.frozen)` in the subgraph)
    # from a tensor that requires grad: no path, as in eager. (Only where an input requires grad: a trace whose
    # inputs did not says nothing of a call whose inputs do.)
    # (Only in a subgraph that switches grad mode itself: a whole capture under no_grad is left as it is.)
    return switches and not value.requires_grad and any(isinstance(v := _val(n), torch.Tensor) and v.requires_grad
                                                        for n in node.all_input_nodes)


def reached_operands(sub: fx.GraphModule) -> frozenset[int] | None:
    """The placeholders (by position) some output of `sub` depends on differentiably; None when `sub` mutates a
    tensor (not analysed)."""
    reach: dict[fx.Node, frozenset[int]] = {}
    position = 0
    switches = any(getattr(n.target, "__name__", "") == "_set_grad_enabled" for n in sub.graph.nodes)
    for node in sub.graph.nodes:
        if node.op == "placeholder":
            reach[node] = frozenset({position})
            position += 1
        elif node.op == "output":
            found: set[int] = set()
            fx.node.map_arg(node.args, lambda n: found.update(reach.get(n, ())))
            return frozenset(found)
        elif _mutates(node):
            return None
        elif _cuts(node, switches):
            reach[node] = frozenset()
        else:
            found = set()
            for n in node.all_input_nodes:
                found.update(reach.get(n, ()))
            reach[node] = frozenset(found)
    return None


def detach_undifferentiated_operands(gm: fx.GraphModule) -> int:
    """Pass each region call of `gm` its operands that require grad but that its subgraph never differentiates
    through, detached (see the Note); returns how many were."""
    reached: dict[str, frozenset[int] | None] = {}
    detached = 0
    for node in gm.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH):
        attr = node.args[0]
        sub = getattr(gm, attr.target, None) if attr.op == "get_attr" else None
        if not isinstance(sub, fx.GraphModule):
            continue
        if attr.target not in reached:
            reached[attr.target] = reached_operands(sub)
        keep = reached[attr.target]
        if keep is None:
            continue
        args = list(node.args)
        for i, operand in enumerate(args[2:]):
            value = _val(operand)
            if i in keep or not isinstance(value, torch.Tensor) or not value.requires_grad:
                continue
            with gm.graph.inserting_before(node):
                cut = gm.graph.call_function(torch.Tensor.detach, (operand,))
            cut.meta["val"] = value.detach()
            args[2 + i] = cut
            detached += 1
        node.args = tuple(args)
    if detached:
        log.info("%d region call operands passed detached: their subgraph does not differentiate through them",
                 detached)
        gm.recompile()
    return detached
