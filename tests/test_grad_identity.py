"""backends/grad_identity.py: region calls whose operands differ in requiring grad from their subgraph's trace get
an identifier and a subgraph copy of their own; calls like the trace keep the shared one."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

import stampout
from stampout.backends import grad_identity
from stampout.torch_internals import INVOKE_SUBGRAPH


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _captured(frozen: int | None) -> fx.GraphModule:
    model = nn.Sequential(_Block(), _Block(), _Block())
    if frozen is not None:
        model[frozen].requires_grad_(False)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    stampout.compile(model, backend=backend, regions="auto")(torch.randn(2, 4, requires_grad=True))
    return graphs[0]


def _calls(gm: fx.GraphModule) -> list[tuple[str, str]]:
    return [(n.args[0].target, n.args[1]) for n in gm.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH)]


def test_calls_like_the_trace_keep_the_shared_subgraph():
    gm = _captured(None)
    before = _calls(gm)
    assert len(set(before)) == 1
    assert grad_identity.separate_by_requires_grad(gm) == 0
    assert _calls(gm) == before


def test_a_frozen_last_call_gets_an_identifier_and_a_subgraph_of_its_own():
    gm = _captured(2)
    first, second, last = _calls(gm)
    assert first == second
    assert grad_identity.separate_by_requires_grad(gm) == 1
    calls = _calls(gm)
    assert calls[:2] == [first, second]
    assert calls[2][1] != first[1] and calls[2][0] != first[0]
    copy = getattr(gm, calls[2][0])
    output = copy.graph.find_nodes(op="output")[0].args[0]
    assert all("val" not in n.meta for n in output if isinstance(n, fx.Node))  # torch reruns it for its metadata
    original = getattr(gm, first[0]).graph.find_nodes(op="output")[0].args[0]
    assert all("val" in n.meta for n in original if isinstance(n, fx.Node))


def test_a_call_whose_outputs_differ_in_requiring_grad_is_separated():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.tanh(self.lin(x)), x * 2  # the second requires grad when x does

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Pair(), Pair(), Pair()])

        def forward(self, x):
            for block in self.blocks:
                x, y = block(x)
            return x + y

    torch.manual_seed(0)
    model, reference = Stack(), Stack()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 4)
    stampout.compile(model, backend="aot_eager", regions="auto")(x).sum().backward()
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.inductor
@pytest.mark.slow
def test_inductor_whole_graph_keeps_the_gradients_of_the_layers_before_a_frozen_last_one():
    # (the whole-graph path sends region calls through AOTAutograd's invoke_subgraph, as aot_eager does)
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block(), _Block())
    reference = nn.Sequential(_Block(), _Block(), _Block())
    reference.load_state_dict(model.state_dict())
    model[2].requires_grad_(False)
    reference[2].requires_grad_(False)
    x = torch.randn(2, 4)
    with stampout.config.patch(glue="whole"):
        stampout.compile(model, backend="inductor", regions="auto")(x).sum().backward()
    reference(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad)


class _TanhBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def test_freezing_the_last_repeated_layer_keeps_the_other_layers_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(_TanhBlock(), _TanhBlock(), _TanhBlock())
    reference = nn.Sequential(_TanhBlock(), _TanhBlock(), _TanhBlock())
    reference.load_state_dict(model.state_dict())
    compiled = stampout.compile(model, backend="aot_eager", regions="auto")
    x = torch.randn(2, 4)
    compiled(x).sum().backward()
    model.zero_grad(set_to_none=True)
    model[2].requires_grad_(False)
    reference[2].requires_grad_(False)
    compiled(x).sum().backward()
    reference(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name  # 0.lin.weight: None, eager has a gradient
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("frozen", [0, 1, 2])
def test_a_repeated_layer_frozen_from_the_start_leaves_the_others_their_gradients(frozen):
    # (torch keys a region's autograd by identifier: the calls whose operands differ in requiring grad from the
    # subgraph's trace get their own, backends/grad_identity.py; freezing the first one failed loudly before)
    torch.manual_seed(0)
    model = nn.Sequential(_TanhBlock(), _TanhBlock(), _TanhBlock())
    reference = nn.Sequential(_TanhBlock(), _TanhBlock(), _TanhBlock())
    reference.load_state_dict(model.state_dict())
    model[frozen].requires_grad_(False)
    reference[frozen].requires_grad_(False)
    x = torch.randn(2, 4)
    stampout.compile(model, backend="aot_eager", regions="auto")(x).sum().backward()
    reference(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad)
