"""Which outputs of a region are views of one base (a split, a chunk, a basic index of one tensor): stamped calls
give them back as views of the stamped base, as eager does, never as separate tensors."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..trace.op_facts import ALWAYS_VIEWS, SPLITS, VIEW_PROPERTIES, op_name
from .cache import Output


def _basic_index(index: Any) -> bool:
    """Indexing with ints, slices, None and ... only (a view); a tensor or list index makes a copy."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) or
               isinstance(i, fx.Node) and not isinstance(i.meta.get("val"), torch.Tensor) for i in items)


def _view_root(node: fx.Node) -> fx.Node:
    """The node whose storage `node` is a view of (following ops that always make views back through the
    graph); `node` itself when it is not a view."""
    while node.op in ("call_function", "call_method") and node.args and isinstance(node.args[0], fx.Node):
        name, source = op_name(node.target), node.args[0]
        if name in ("getitem", "__getitem__") and not isinstance(source.meta.get("val"), torch.Tensor):
            if op_name(source.target) not in SPLITS:  # an item of an op's tuple result (torch.max): its own tensor
                break
            source = source.args[0]  # a piece of a split: a view of what was split
        elif name in ("getitem", "__getitem__"):
            if len(node.args) < 2 or not _basic_index(node.args[1]):
                break
        elif name == "getattr":
            if len(node.args) < 2 or node.args[1] not in VIEW_PROPERTIES:
                break
        elif name not in ALWAYS_VIEWS:
            break
        node = source
        if not isinstance(node, fx.Node):
            break
    return node


def views_of_one_base(returned: list[fx.Node], outputs: list[tuple], holes: list) -> tuple[list, list]:
    """Outputs that are views of one tensor (`return h[:, :n], h[:, n:]`): the subgraph returns that tensor
    once, and the caller's graph takes the views with `as_strided` (same sizes, strides, offsets). Aliasing
    outputs of a reused subgraph get wrong values from torch 2.13's Inductor; this way there are none, and the
    caller still sees views of one storage, as in eager. Outputs that are views of an input (`return x[:2]`,
    a buffer's slice) are taken from the caller's operand the same way (IN_VIEW: the placeholder, sizes,
    strides, and the offset relative to the input's own), so writes through them reach the input."""
    groups: dict[fx.Node, list[int]] = {}
    new_outputs: list[tuple] = list(outputs)
    for k, (kind, j) in enumerate(outputs):
        if kind is not Output.OUT:
            continue
        root = _view_root(returned[j])
        if root.op == "placeholder":
            base = root.meta["val"]
            t = holes[k]
            index = [n for n in root.graph.nodes if n.op == "placeholder"].index(root)
            new_outputs[k] = (Output.IN_VIEW, index, tuple(t.shape), tuple(t.stride()),
                              t.storage_offset() - base.storage_offset())
        else:
            groups.setdefault(root, []).append(k)
    keep: list[fx.Node] = []

    def index_of(node: fx.Node) -> int:
        if node not in keep:
            keep.append(node)
        return keep.index(node)

    for root, members in groups.items():
        if len({outputs[k][1] for k in members}) < 2:
            continue
        r = index_of(root)
        for k in members:
            t = holes[k]
            new_outputs[k] = (Output.VIEW, r, tuple(t.shape), tuple(t.stride()), t.storage_offset())
    for k, (kind, *rest) in enumerate(new_outputs):
        if kind is Output.OUT:
            new_outputs[k] = (Output.OUT, index_of(returned[rest[0]]))
    return keep, new_outputs
