"""Nodes stampout appends without fx.Graph.create_node get the names create_name would give them: the same names and
the same namespace state after any sequence of candidates (suffixes, clashes, Python builtins and keywords)."""

from __future__ import annotations

import operator

import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st

from stampout.torch_internals import graphs

_PARTS = st.sampled_from(["x", "getitem", "layers", "attn", "list", "for", "str", "_", "a", "0", "12", "7", "", "Z",
                          "weight", "invoke_subgraph", "\u0661", "-", "1x"])
_CANDIDATES = st.lists(_PARTS, min_size=1, max_size=4).map("_".join)


def test_the_fast_path_is_on_for_this_torch() -> None:
    assert graphs._FAST_NAMES


@settings(max_examples=300, deadline=None)
@given(st.lists(_CANDIDATES, min_size=1, max_size=30))
def test_names_and_namespace_state_match_create_name(candidates: list[str]) -> None:
    theirs, ours = fx.Graph()._graph_namespace, fx.Graph()._graph_namespace
    for c in candidates:
        assert graphs._fast_name(ours, c) == theirs.create_name(c, None), c
    assert ours._used_names == theirs._used_names
    assert dict(ours._base_count) == dict(theirs._base_count)


def test_a_stamped_graph_names_its_nodes_as_create_node_does() -> None:
    slow, fast = fx.Graph(), fx.Graph()
    for graph, append in ((slow, lambda g, *a: g.create_node(*a)), (fast, graphs.append_node)):
        x = append(graph, "placeholder", "layers_3_attn_qkv_weight")
        append(graph, "placeholder", "layers_3_attn_qkv_weight")
        append(graph, "placeholder", "list")
        sub = append(graph, "get_attr", "subgraph_0")
        call = append(graph, "call_function", graphs.INVOKE_SUBGRAPH, (sub, "subgraph_0", x))
        for i in range(3):
            append(graph, "call_function", operator.getitem, (call, i))
    assert [n.name for n in fast.nodes] == [n.name for n in slow.nodes]
