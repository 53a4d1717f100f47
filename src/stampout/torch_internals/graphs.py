"""FX graphs in torch's conventions: a region call as `invoke_subgraph`, graph modules without nn.Module hooks, and
`append_node` (fx.Graph.create_node without its per-node argument scan).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx as fx

INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


def invoke_subgraph(graph: fx.Graph, subgraph: fx.Node, name: str, operands: list[Any]) -> fx.Node:
    """Append a region call in torch's calling convention: `invoke_subgraph(get_attr, name, *operands)`;
    its result is a tuple of the subgraph's outputs."""
    return append_node(graph, "call_function", INVOKE_SUBGRAPH, (subgraph, name, *operands))


def _forward_only(module: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    return module.forward(*args, **kwargs)


def without_module_hooks(gm: fx.GraphModule) -> fx.GraphModule:
    """Make `gm` and the graph modules in it run their code without nn.Module's hooks when called. A global
    hook the user registered (`register_module_forward_hook`) is for the user's modules, and ran on them when
    the program was captured; stampout's graphs are no modules of the user's. (A GraphModule's call goes to its
    class's `_wrapped_call`, which `recompile` keeps once set; each GraphModule has a class of its own.)"""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            cls = type(module)
            cls._wrapped_call = staticmethod(_forward_only)
            cls.__call__ = _forward_only  # (a lazy one before its first recompile; recompile keeps the above)
    return gm


def is_region_call(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is INVOKE_SUBGRAPH


# fx.Graph.create_node, without its per-node scan of the arguments for raw SymInts: stampout's arguments never
# hold one (a symbolic size becomes a node first). The private fields it writes are checked once, here; without
# them (another torch), or for a graph whose owning module may carry node hooks, create_node is used.
_PROBE = fx.Graph()
_FAST_NODES = all(hasattr(_PROBE, f) for f in ("_graph_namespace", "_insert", "_find_nodes_lookup_table", "_len",
                                               "_target_to_str", "owning_module")) and all(
    hasattr(_PROBE._graph_namespace, f) for f in ("create_name", "associate_name_with_obj")) and hasattr(
    _PROBE._find_nodes_lookup_table, "insert")


def _fast_name(namespace: Any, candidate: str) -> str:
    """`namespace.create_name(candidate, None)` for a candidate that is an ASCII identifier: its numeric suffix split
    off by `rpartition` where create_name runs a backtracking regex (~3 us a name; a stamped layer names ten
    nodes); the rest as create_name does it. Other candidates, and a torch whose namespace differs (checked below,
    once, against create_name itself): create_name."""
    if not (_FAST_NAMES and candidate.isascii() and candidate.isidentifier()):
        return namespace.create_name(candidate, None)
    head, sep, tail = candidate.rpartition("_")  # (the regex's lazy base: up to the last `_` before digits only)
    base, num = (head, tail) if sep and head and tail.isdigit() else (candidate, None)
    used = namespace._used_names
    if num is None or candidate in used:
        num = namespace._base_count.get(base, 0)
        if _ILLEGAL_NAMES.get(candidate, None) is not None:
            num += 1
            candidate = f"{base}_{num}"
    else:
        num = int(num)
    while candidate in used:
        num += 1
        candidate = f"{base}_{num}"
    used.add(candidate)
    namespace._base_count[base] = num
    return candidate


def _names_agree() -> bool:
    """Whether `_fast_name` names as this torch's create_name does (same names, same state after), on candidates
    that take each of its paths."""
    import torch.fx.graph as fx_graph

    global _ILLEGAL_NAMES
    _ILLEGAL_NAMES = getattr(fx_graph, "_illegal_names", None)
    if type(_ILLEGAL_NAMES) is not dict:
        return False
    theirs, ours = fx.Graph()._graph_namespace, fx.Graph()._graph_namespace
    if not all(hasattr(theirs, f) for f in ("_used_names", "_base_count")):
        return False
    candidates = ["x", "x", "x_1", "x_1", "x_7", "x", "getitem", "getitem_3", "getitem", "a__5", "a_", "_", "__3",
                  "_3", "layers_3_attn_qkv_weight", "layers_3_attn_qkv_weight", "list", "list", "for", "str_2",
                  "invoke_subgraph", "invoke_subgraph_0", "invoke_subgraph", "x1", "x1_0", "x1"]
    try:
        same = all(theirs.create_name(c, None) == _fast_name(ours, c) for c in candidates)
    except Exception:
        return False
    return same and theirs._used_names == ours._used_names and dict(theirs._base_count) == dict(ours._base_count)


_ILLEGAL_NAMES: dict | None = None
_FAST_NAMES = True
_FAST_NAMES = _FAST_NODES and _names_agree()
del _PROBE
_NO_KWARGS = fx.immutable_collections.immutable_dict()


def _target_name(graph: fx.Graph, target: Any) -> str:
    """`graph._target_to_str(target)` (the base of a node's name): its snake-casing regex is skipped for the
    names it leaves as they are, those with no capital letter (`layers_0_weight`, `getitem`, `invoke_subgraph`)."""
    if callable(target):
        op = target.__name__
    elif type(target) is str and not (target.startswith("__") and target.endswith("__")):
        op = target
    else:
        return graph._target_to_str(target)
    return op if op == op.lower() else graph._target_to_str(target)


def append_node(graph: fx.Graph, op: str, target: Any, args: tuple = (), kwargs: dict | None = None,
                name: str | None = None, after: fx.Node | None = None, before: fx.Node | None = None) -> fx.Node:
    """`graph.create_node(op, target, args, kwargs, name)` at the graph's insertion point (or right after
    `after` / before `before`, as under `graph.inserting_after`/`inserting_before`): the same node, name and
    place, for a few microseconds less per node (a stamped region call emits about ten)."""
    if not _FAST_NODES or graph.owning_module is not None:
        where = (graph.inserting_after(after) if after is not None else graph.inserting_before(before)
                 if before is not None else contextlib.nullcontext())
        with where:
            return graph.create_node(op, target, args, kwargs, name)
    name = _fast_name(graph._graph_namespace, _target_name(graph, target) if name is None else name)
    node = fx.Node(graph, name, op, target, args, kwargs or _NO_KWARGS, None)
    graph._graph_namespace.associate_name_with_obj(name, node)
    if after is not None:
        after.append(node)
    elif before is not None:
        before.prepend(node)
    else:
        graph._insert(node)
    graph._find_nodes_lookup_table.insert(node)
    graph._len += 1
    return node
