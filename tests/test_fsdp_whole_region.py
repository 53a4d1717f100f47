"""A graph that is one region call (a sharded block's piece): aot_eager compiles the region's subgraph itself
(backends/whole_region.py), with eager's values and gradients, once for every piece calling that subgraph."""

from __future__ import annotations

import torch
import torch.fx as fx

import stampout
from stampout.backends import aot_eager
from stampout.backends.whole_region import whole_region


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    @stampout.region
    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x))), x * 2


def _capture(block: Block, x: torch.Tensor):
    return stampout.capture(lambda x: block(x), x)


def test_a_graph_of_one_region_call_is_its_subgraph():
    torch.manual_seed(0)
    block, x = Block(), torch.randn(3, 8)
    cap = _capture(block, x)
    whole = whole_region(cap.gm)
    assert whole is not None and whole.subgraph is cap.gm.subgraph_0
    inputs = cap.placeholders_for((x,), {})
    for got, want in zip(whole.subgraph(*whole.inputs(inputs)), cap.gm(*inputs)):
        torch.testing.assert_close(got, want)


def test_more_than_the_region_call_is_not():
    torch.manual_seed(0)
    block, x = Block(), torch.randn(3, 8)
    cap = stampout.capture(lambda x: block(x)[0] + 1, x)
    assert whole_region(cap.gm) is None
    cap2 = _capture(block, x)
    assert whole_region(cap2.gm) is not None
    assert whole_region(fx.GraphModule(cap2.gm, _reordered(cap2.gm))) is None


def _reordered(gm: fx.GraphModule) -> fx.Graph:
    graph = fx.Graph()
    env: dict = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            first, second = node.args[0][:2]
            graph.output((env[second], env[first], *(env[n] for n in node.args[0][2:])))
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    return graph


def test_aot_eager_trains_a_single_region_graph_as_eager():
    torch.manual_seed(0)
    block, x = Block(), torch.randn(3, 8, requires_grad=True)
    ref = Block()
    ref.load_state_dict(block.state_dict())
    cap = _capture(block, x)
    inputs = cap.placeholders_for((x,), {})
    compiled = aot_eager.compile_graph(cap.gm, inputs)
    again = aot_eager.compile_graph(cap.gm, inputs)
    assert again is compiled  # (one compile per subgraph and input metadata)
    assert compiled.__qualname__.startswith("WholeRegion.wrap")  # the subgraph compiled, not the region call
    out = compiled(*inputs)
    x_ref = x.detach().clone().requires_grad_(True)
    want = ref(x_ref)
    for got, expected in zip(out, want):
        torch.testing.assert_close(got, expected)
    sum(o.sum() for o in out).backward()
    sum(w.sum() for w in want).backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for p, q in zip(block.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
