"""Golden printouts: the graphs stampout builds for small cases, as FX prints them."""

from __future__ import annotations

import torch
from torch import nn

import stampout


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @stampout.region
    def forward(self, x):
        return torch.relu(self.lin(x)) + x


OUTER = """
def forward(self, input, _0_lin_weight, _0_lin_bias, _1_lin_weight, _1_lin_bias):
    input_1 = input
    subgraph_0 = self.subgraph_0
    invoke_subgraph = torch.ops.higher_order.invoke_subgraph(subgraph_0, 'subgraph_0', input_1, _0_lin_weight, _0_lin_bias);  subgraph_0 = input_1 = _0_lin_weight = _0_lin_bias = None
    getitem = invoke_subgraph[0];  invoke_subgraph = None
    subgraph_1 = self.subgraph_0
    invoke_subgraph_1 = torch.ops.higher_order.invoke_subgraph(subgraph_1, 'subgraph_0', getitem, _1_lin_weight, _1_lin_bias);  subgraph_1 = getitem = _1_lin_weight = _1_lin_bias = None
    getitem_1 = invoke_subgraph_1[0];  invoke_subgraph_1 = None
    return (getitem_1,)
"""  # noqa: E501

REGION = """
def forward(self, x, self_lin_weight, self_lin_bias):
    linear = torch._C._nn.linear(x, self_lin_weight, self_lin_bias);  self_lin_weight = self_lin_bias = None
    relu = torch.relu(linear);  linear = None
    add = relu.add(x);  relu = x = None
    return (add,)
"""


def test_region_stack_graphs():
    cap = stampout.capture(nn.Sequential(Layer(), Layer()), torch.randn(2, 4))
    cap.gm.graph.lint()
    assert cap.gm.code.strip() == OUTER.strip()
    assert cap.gm.subgraph_0.code.strip() == REGION.strip()


def test_grad_mode_and_autocast_sections_stay_in_the_graph():
    def fn(x):
        with torch.no_grad():
            y = x * 2
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = y @ y.T
        return z

    code = stampout.capture(fn, torch.randn(3, 3)).gm.code
    assert code.index("_set_grad_enabled(False)") < code.index("mul") < code.index("_set_grad_enabled(True)")
    assert code.index("_enter_autocast") < code.index("matmul") < code.index("_exit_autocast")
