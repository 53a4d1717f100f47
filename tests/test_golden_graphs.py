"""Golden printouts of stamped graphs: the outer graph a capture builds for a stack with reused regions and the
region subgraphs it calls, as FX prints them. A layer that differs gets its own subgraph; a region that writes a
cache in place keeps the write in its subgraph; under `dynamic=True` the sizes a region needs are read once in the
outer graph and passed to every stamped call. (test_golden.py has the two-layer stack.)"""

from __future__ import annotations

import torch
from torch import nn

import stampout


class Layer(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = scale

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * self.scale + x


class CacheLayer(nn.Module):
    """A static cache's write: `index_copy_` into the buffer the region is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    @stampout.region
    def forward(self, x: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys.index_copy_(1, pos, self.proj(x))
        return x + keys.sum(1, keepdim=True), keys.amax(1)


class CacheStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CacheLayer() for _ in range(2))

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor], pos: torch.Tensor) -> tuple:
        peaks = []
        for layer, keys in zip(self.layers, caches):
            x, peak = layer(x, keys, pos)
            peaks.append(peak)
        return x, peaks


class Heads(nn.Module):
    """Splits into heads by the input's sizes: symbolic under `dynamic=True`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.lin(x).view(b, t, 2, 2).transpose(1, 2)
        return x + h.softmax(-1).transpose(1, 2).reshape(b, t, 4)


def printed(gm: torch.fx.GraphModule) -> dict[str, str]:
    """The outer graph's code and each subgraph's, by attribute name (after `graph.lint()`)."""
    gm.graph.lint()
    return {"": gm.code.strip(), **{name: sub.code.strip() for name, sub in gm.named_children()}}


def golden(printouts: dict[str, str]) -> dict[str, str]:
    return {name: code.strip() for name, code in printouts.items()}


DIFFERING = {
    "": """
def forward(self, input, _0_lin_weight, _0_lin_bias, _1_lin_weight, _1_lin_bias, _2_lin_weight, _2_lin_bias):
    input_1 = input
    subgraph_0 = self.subgraph_0
    invoke_subgraph = torch.ops.higher_order.invoke_subgraph(subgraph_0, 'subgraph_0', input_1, _0_lin_weight, _0_lin_bias);  subgraph_0 = input_1 = _0_lin_weight = _0_lin_bias = None
    getitem = invoke_subgraph[0];  invoke_subgraph = None
    subgraph_1 = self.subgraph_1
    invoke_subgraph_1 = torch.ops.higher_order.invoke_subgraph(subgraph_1, 'subgraph_1', getitem, _1_lin_weight, _1_lin_bias);  subgraph_1 = getitem = _1_lin_weight = _1_lin_bias = None
    getitem_1 = invoke_subgraph_1[0];  invoke_subgraph_1 = None
    subgraph_2 = self.subgraph_0
    invoke_subgraph_2 = torch.ops.higher_order.invoke_subgraph(subgraph_2, 'subgraph_0', getitem_1, _2_lin_weight, _2_lin_bias);  subgraph_2 = getitem_1 = _2_lin_weight = _2_lin_bias = None
    getitem_2 = invoke_subgraph_2[0];  invoke_subgraph_2 = None
    return (getitem_2,)
""",  # noqa: E501
    "subgraph_0": """
def forward(self, x, self_lin_weight, self_lin_bias):
    linear = torch._C._nn.linear(x, self_lin_weight, self_lin_bias);  self_lin_weight = self_lin_bias = None
    relu = torch.relu(linear);  linear = None
    mul = relu.mul(1.0);  relu = None
    add = mul.add(x);  mul = x = None
    return (add,)
""",  # noqa: E501
    "subgraph_1": """
def forward(self, x, self_lin_weight, self_lin_bias):
    linear = torch._C._nn.linear(x, self_lin_weight, self_lin_bias);  self_lin_weight = self_lin_bias = None
    relu = torch.relu(linear);  linear = None
    mul = relu.mul(2.0);  relu = None
    add = mul.add(x);  mul = x = None
    return (add,)
""",  # noqa: E501
}


def test_a_layer_that_differs_is_traced_into_its_own_subgraph():
    """The middle layer's `scale` differs: subgraph_1 is its trace; the layers around it share subgraph_0."""
    cap = stampout.capture(nn.Sequential(Layer(), Layer(2.0), Layer()), torch.randn(2, 4))
    assert (cap.stats.traces, cap.stats.reuses, cap.stats.subgraphs) == (2, 1, 2)
    assert printed(cap.gm) == golden(DIFFERING)


CACHE_WRITE = {
    "": """
def forward(self, x, caches_0, caches_1, pos, layers_0_proj_weight, layers_0_proj_bias, layers_1_proj_weight, layers_1_proj_bias):
    subgraph_0 = self.subgraph_0
    invoke_subgraph = torch.ops.higher_order.invoke_subgraph(subgraph_0, 'subgraph_0', x, caches_0, pos, layers_0_proj_weight, layers_0_proj_bias);  subgraph_0 = x = caches_0 = layers_0_proj_weight = layers_0_proj_bias = None
    getitem = invoke_subgraph[0]
    getitem_1 = invoke_subgraph[1];  invoke_subgraph = None
    subgraph_1 = self.subgraph_0
    invoke_subgraph_1 = torch.ops.higher_order.invoke_subgraph(subgraph_1, 'subgraph_0', getitem, caches_1, pos, layers_1_proj_weight, layers_1_proj_bias);  subgraph_1 = getitem = caches_1 = pos = layers_1_proj_weight = layers_1_proj_bias = None
    getitem_2 = invoke_subgraph_1[0]
    getitem_3 = invoke_subgraph_1[1];  invoke_subgraph_1 = None
    return (getitem_2, getitem_1, getitem_3)
""",  # noqa: E501
    "subgraph_0": """
def forward(self, x, keys, pos, self_proj_weight, self_proj_bias):
    linear = torch._C._nn.linear(x, self_proj_weight, self_proj_bias);  self_proj_weight = self_proj_bias = None
    index_copy_ = keys.index_copy_(1, pos, linear);  keys = pos = linear = None
    sum_1 = index_copy_.sum(1, keepdim = True)
    add = x.add(sum_1);  x = sum_1 = None
    amax = index_copy_.amax(1);  index_copy_ = None
    return (add, amax)
""",  # noqa: E501
}


def test_a_region_writing_its_cache_in_place_keeps_the_write_in_its_subgraph():
    caches = [torch.zeros(2, 3, 4) for _ in range(2)]
    cap = stampout.capture(CacheStack(), torch.randn(2, 1, 4), caches, torch.tensor([1]))
    assert cap.stats.subgraphs == 1
    assert printed(cap.gm) == golden(CACHE_WRITE)


SYMBOLIC = {
    "": """
def forward(self, input, _0_lin_weight, _0_lin_bias, _1_lin_weight, _1_lin_bias):
    input_1 = input
    sym_size_int = torch.ops.aten.sym_size.int(input_1, 0)
    sym_size_int_1 = torch.ops.aten.sym_size.int(input_1, 1)
    subgraph_0 = self.subgraph_0
    invoke_subgraph = torch.ops.higher_order.invoke_subgraph(subgraph_0, 'subgraph_0', input_1, _0_lin_weight, _0_lin_bias, sym_size_int, sym_size_int_1);  subgraph_0 = input_1 = _0_lin_weight = _0_lin_bias = None
    getitem = invoke_subgraph[0];  invoke_subgraph = None
    subgraph_1 = self.subgraph_0
    invoke_subgraph_1 = torch.ops.higher_order.invoke_subgraph(subgraph_1, 'subgraph_0', getitem, _1_lin_weight, _1_lin_bias, sym_size_int, sym_size_int_1);  subgraph_1 = getitem = _1_lin_weight = _1_lin_bias = sym_size_int = sym_size_int_1 = None
    getitem_1 = invoke_subgraph_1[0];  invoke_subgraph_1 = None
    return (getitem_1,)
""",  # noqa: E501
    "subgraph_0": """
def forward(self, x, self_lin_weight, self_lin_bias, s31, s81):
    linear = torch._C._nn.linear(x, self_lin_weight, self_lin_bias);  self_lin_weight = self_lin_bias = None
    view = linear.view(s31, s81, 2, 2);  linear = None
    transpose = view.transpose(1, 2);  view = None
    softmax = transpose.softmax(-1);  transpose = None
    transpose_1 = softmax.transpose(1, 2);  softmax = None
    reshape = transpose_1.reshape(s31, s81, 4);  transpose_1 = s31 = s81 = None
    add = x.add(reshape);  x = reshape = None
    return (add,)
""",  # noqa: E501
}


def test_symbolic_sizes_are_read_once_and_passed_to_every_stamped_call():
    fn = stampout.compile(nn.Sequential(Heads(), Heads()), backend="eager", dynamic=True)
    fn(torch.randn(2, 3, 4))
    cap = fn.last_capture
    assert (cap.stats.traces, cap.stats.reuses) == (1, 1)
    assert printed(cap.gm) == golden(SYMBOLIC)
