"""Facts about ops that more than one pass needs, kept once: where a function takes `inplace`."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from stampout import caches
from stampout.backends.split import writes_in_place
from stampout.trace import op_facts
from stampout.trace.op_facts import inplace_position


def _node(target, *args):
    graph = fx.Graph()
    x = graph.placeholder("x")
    return graph.call_function(target, (x, *args))


def test_the_inplace_position_is_one_fact_for_capture_and_split():
    assert inplace_position(F.relu) == 1 and inplace_position(F.dropout) == 3 and inplace_position(torch.add) is None
    x = torch.randn(2)
    assert op_facts.writes_in_place(F.relu, (x, True)) and not op_facts.writes_in_place(F.relu, (x, False))
    assert writes_in_place(_node(F.relu, True)) and not writes_in_place(_node(F.relu, False))
    assert F.relu in caches.registered()["op_facts inplace positions"]


def test_unhashable_callables_and_ones_without_a_signature():
    class Unhashable:
        __hash__ = None

        def __call__(self, x, inplace=False):
            return x

    assert inplace_position(Unhashable()) == 1
    assert inplace_position(print) is None
