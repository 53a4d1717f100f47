"""`torch_internals.append_node` builds the node `fx.Graph.create_node` would (name, place, args, users), and the
names walk still names tensor attributes of modules (it skips only the fields nn.Module sets itself)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn

import stampout
from stampout.torch_internals import append_node
from stampout.trace.names import TensorNames


def _build(make) -> fx.Graph:
    g = fx.Graph()
    x = make(g, "placeholder", "x", (), None)
    y = make(g, "call_function", operator.getitem, (x, 0), None)
    z = make(g, "call_function", operator.getitem, (y, 1), None)
    make(g, "call_function", torch.add, (y, z), {"alpha": 2})
    make(g, "get_attr", "subgraph_0", (), None)
    make(g, "placeholder", "getitem", (), None)  # a name already taken by a call: renamed alike
    g.output((z,))
    return g


def _describe(g: fx.Graph) -> list[tuple]:
    def named(a):
        return fx.map_arg(a, lambda n: n.name)

    return [(n.name, n.op, n.target, named(n.args), named(dict(n.kwargs)), sorted(u.name for u in n.users))
            for n in g.nodes]


def test_append_node_matches_create_node() -> None:
    fast = _build(lambda g, op, target, args, kwargs: append_node(g, op, target, args, kwargs))
    slow = _build(lambda g, op, target, args, kwargs: g.create_node(op, target, args, kwargs))
    assert _describe(fast) == _describe(slow)
    fast.lint()
    assert fast.python_code("self").src == slow.python_code("self").src


def _Camel(x):  # noqa: N802 - a target whose name FX snake-cases
    return x


def test_append_node_names_nodes_as_create_node_for_every_kind_of_target_name() -> None:
    """The names FX snake-cases (capitals, a magic name) and the ones it keeps (lower case, digits) alike."""
    targets = [("placeholder", "W_q"), ("placeholder", "layers_0_attn_qkv_weight"), ("placeholder", "__magic__"),
               ("placeholder", "getitem_1"), ("placeholder", "mixedCase"), ("call_function", _Camel),
               ("call_function", operator.getitem), ("get_attr", "Subgraph_0"), ("call_method", "__add__")]

    def build(make) -> fx.Graph:
        g = fx.Graph()
        x = make(g, "placeholder", "x", ())
        for op, target in targets:
            make(g, op, target, (x,) if op in ("call_function", "call_method") else ())
        return g

    fast = build(lambda g, op, target, args: append_node(g, op, target, args))
    slow = build(lambda g, op, target, args: g.create_node(op, target, args))
    assert _describe(fast) == _describe(slow)
    assert [n.name for n in fast.nodes][1:6] == ["w_q", "layers_0_attn_qkv_weight", "magic", "getitem_1",
                                                 "mixed_case"]


def test_append_node_inserts_after_and_before_as_the_insertion_contexts() -> None:
    fast, slow = fx.Graph(), fx.Graph()
    for g in (fast, slow):
        g.output(g.call_function(torch.neg, (g.placeholder("a"),)))
    a_fast, a_slow = next(iter(fast.nodes)), next(iter(slow.nodes))
    append_node(fast, "placeholder", "b", after=a_fast)
    append_node(fast, "placeholder", "first", before=a_fast)
    with slow.inserting_after(a_slow):
        slow.placeholder("b")
    with slow.inserting_before(a_slow):
        slow.placeholder("first")
    assert _describe(fast) == _describe(slow)
    fast.lint()


def test_append_node_on_an_owned_graph_goes_through_create_node() -> None:
    gm = fx.symbolic_trace(nn.ReLU())
    seen: list[str] = []
    gm._register_create_node_hook(lambda n: seen.append(n.name))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    node = append_node(gm.graph, "call_function", torch.neg, (out.args[0],), before=out)
    assert seen == [node.name]  # the owning module's node hook ran
    gm.graph.lint()


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = torch.full((3,), 2.0)  # a plain tensor attribute (neither parameter nor buffer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_names_walk_finds_tensor_attributes_parameters_and_buffers() -> None:
    m = nn.Sequential(_Scaled(), _Scaled())
    m.register_buffer("offset", torch.zeros(3))
    names = TensorNames(m)
    assert names.find(m[1].scale)[0] == "1.scale"
    assert names.find(m[0].lin.weight)[0] == "0.lin.weight"
    assert names.find(m.offset)[0] == "offset"
    cap = stampout.capture(m, torch.randn(2, 3))
    assert {"_1_scale", "_0_lin_weight"} <= {n.name for n in cap.gm.graph.nodes if n.op == "placeholder"}
