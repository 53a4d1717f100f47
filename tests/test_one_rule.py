"""One table of op facts (stampout.op_facts) that the tracer, known constants, region views and split ask,
and the cases where the copies it replaced disagreed and one was wrong."""

from __future__ import annotations

import builtins
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import stampout
from stampout.backends.split import may_alias_an_input, writes_an_input, writes_in_place
from stampout.errors import CaptureError
from stampout.trace import op_facts


def _node(target, *args, op="call_function", **kwargs):
    graph = fx.Graph()
    x = graph.placeholder("x")
    if op == "call_method":
        return graph.call_method(target, (x, *args), kwargs)
    return graph.call_function(target, (x, *args), kwargs)


IN_PLACE = [
    (torch.Tensor.add_, "add_"), (torch.Tensor.__iadd__, "__iadd__"), (torch.Tensor.__imul__, "__imul__"),
    (torch.ops.aten.add_.Tensor, None), (torch.ops.aten.copy_.default, None), (operator.setitem, None),
    (torch.Tensor.__setitem__, "__setitem__"),
]
NOT_IN_PLACE = [
    (torch.Tensor.add, "add"), (torch.Tensor.__add__, "__add__"), (torch.Tensor.__invert__, "__invert__"),
    (torch.Tensor.__index__, "__index__"), (torch.ops.aten.add.Tensor, None), (torch.Tensor.__init__, None),
]


@pytest.mark.parametrize(("func", "method"), IN_PLACE)
def test_in_place_ops_are_in_place_for_the_tracer_and_for_split(func, method):
    x = torch.zeros(2)
    assert op_facts.writes_in_place(func, (x, x), {})
    assert writes_in_place(_node(func, 1.0))
    if method is not None:
        assert writes_in_place(_node(method, 1.0, op="call_method"))


@pytest.mark.parametrize(("func", "method"), NOT_IN_PLACE)
def test_other_ops_are_not(func, method):
    x = torch.zeros(2)
    assert not op_facts.writes_in_place(func, (x, x), {})
    assert not writes_in_place(_node(func, 1.0))
    if method is not None:
        assert not writes_in_place(_node(method, 1.0, op="call_method"))


def test_out_and_inplace_arguments_write():
    x = torch.zeros(2)
    assert op_facts.writes_in_place(torch.add, (x, x), {"out": x})
    assert op_facts.writes_in_place(F.relu, (x, True), {}) and not op_facts.writes_in_place(F.relu, (x, False), {})
    assert op_facts.written(torch.ops.aten.add_.Tensor, (x, 1), {})[0] is x
    assert op_facts.written(torch.add, (x, 1), {"out": [x]}) == [x, x]


def _aten_add_into_a_constant(x):
    m = torch.zeros(3)
    torch.ops.aten.add_.Tensor(m, x)  # m no longer holds a value known while tracing
    if bool((m == 0).all()):
        return x + 1
    return x - 1


def test_an_aten_in_place_overload_forgets_a_known_constant():
    # constants.mutating read `add_.Tensor` by its name, which does not end in "_": the capture kept m's value
    # as zeros and baked in the wrong branch. Now the branch needs m's value, which only the run knows.
    with pytest.raises(CaptureError, match="data-dependent"):
        stampout.capture(_aten_add_into_a_constant, torch.randn(3))
    x = torch.randn(3)
    compiled = stampout.compile(_aten_add_into_a_constant, backend="eager")
    torch.testing.assert_close(compiled(x), _aten_add_into_a_constant(x))


def _subgraph(body):
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(body(graph, x))
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("view", [
    lambda g, x: g.call_function(builtins.getattr, (x, "mT")),
    lambda g, x: g.call_method("moveaxis", (x, 0, 1)),
    lambda g, x: g.call_function(operator.getitem, (g.call_method("split_with_sizes", (x, [1, 1])), 0)),
])
def test_split_knows_every_view_the_region_layer_knows(view):
    # split's own alias table lacked moveaxis, split_with_sizes and the view properties (`x.mT`), which
    # regions/views.py counted as views: a region returning or writing such a view of its input was taken
    # for one that only touches tensors it made.
    assert may_alias_an_input(_subgraph(view))

    def writes(g, x):
        g.call_method("add_", (view(g, x), 1))
        return g.call_method("sum", (x,))

    assert writes_an_input(_subgraph(writes))


def test_a_region_writing_only_its_own_tensors_does_not_write_an_input():
    def own(g, x):
        y = g.call_method("clone", (x,))
        g.call_method("add_", (g.call_method("moveaxis", (y, 0, 1)), 1))
        return y

    assert not writes_an_input(_subgraph(own))



_LIB = torch.library.Library("stampout_one_rule", "DEF")
_LIB.define("fill_into(Tensor(a!) m, Tensor x) -> ()")


def _fill_into(m, x):
    m.copy_(x)


_LIB.impl("fill_into", _fill_into, "CompositeExplicitAutograd")
torch.library.register_fake("stampout_one_rule::fill_into", lambda m, x: None, lib=_LIB)


def _custom_packet_into_a_constant(x):
    m = torch.zeros(3)
    torch.ops.stampout_one_rule.fill_into(m, x)  # the packet, as a user writes it: its one overload writes m
    if bool((m == 0).all()):
        return x + 1
    return x - 1


def test_a_custom_op_packet_that_writes_forgets_a_known_constant():
    # op_facts read only an overload's schema, so a call of the packet (`torch.ops.ns.op(...)`, what the tracer
    # sees) was not in place: the capture kept m as zeros and baked in the wrong branch. The inline backend's own
    # predicate looked at every overload of a packet; both now ask op_facts.
    packet = torch.ops.stampout_one_rule.fill_into
    m, x = torch.zeros(3), torch.ones(3)
    assert op_facts.writes_in_place(packet, (m, x), {}) and op_facts.written(packet, (m, x), {}) == [m]
    assert op_facts.custom_op_writes(packet) and op_facts.custom_op_writes(packet.default)
    with pytest.raises(CaptureError, match="data-dependent"):
        stampout.capture(_custom_packet_into_a_constant, torch.randn(3))
    compiled = stampout.compile(_custom_packet_into_a_constant, backend="eager")
    torch.testing.assert_close(compiled(x), _custom_packet_into_a_constant(x))


def test_an_aten_packet_writes_only_where_the_call_passes_what_an_overload_writes():
    # (aten.add has an `out` overload: a packet call writes only when it passes `out=`)
    x = torch.zeros(2)
    assert not op_facts.writes_in_place(torch.ops.aten.add, (x, x), {}) and not op_facts.custom_op_writes(
        torch.ops.aten.add_)
    assert op_facts.writes_in_place(torch.ops.aten.add, (x, x), {"out": x})
    assert op_facts.writes_in_place(torch.ops.aten.add_, (x, x), {})
