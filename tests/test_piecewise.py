"""Piecewise compile: the part of a model that cannot be captured runs eagerly, the rest is compiled."""

from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch
import torch.utils.checkpoint
from helpers import named_grads, tree_assert_close
from torch import nn

import stampout


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(torch.relu(self.lin(x))) + x


class Gate(nn.Module):
    """Data-dependent Python: the scale is read from the data (`.item()`), then its children run."""

    def __init__(self):
        super().__init__()
        self.inner = Block()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        scale = x.abs().max().item()  # the graph break
        if scale > 1.0:
            x = x / scale
        return self.proj(self.inner(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList([Block(), Gate(), Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def counted(fn):
    """Each piece's own captures (its `stats` count its own pieces' too)."""
    return {path: piece._counts.captures for path, piece in fn.pieces.items()}


def test_item_in_a_middle_layer_compiles_the_rest(caplog):
    model = Net()
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="aot_eager")
    with caplog.at_level(logging.WARNING, logger="stampout"):
        for scale in (1.0, 5.0, 1.0):
            x = (torch.randn(3, 4) * scale).requires_grad_()
            x_ref = x.detach().clone().requires_grad_()
            out, expected = fn(x), reference(x_ref)
            tree_assert_close(out, expected)
            out.sum().backward()
            expected.sum().backward()
            tree_assert_close(named_grads(model), named_grads(reference))
            tree_assert_close(x.grad, x_ref.grad)
            model.zero_grad()
            reference.zero_grad()
    # the root's own code runs eagerly; every other module around the break is compiled, once
    assert counted(fn) == {"embed": 1, "layers.0": 1, "layers.1": 0, "layers.2": 1, "head": 1}
    gate = fn.pieces["layers.1"]
    assert counted(gate) == {"layers.1.inner": 1, "layers.1.proj": 1}
    assert [(b.module, b.module_type) for b in fn.breaks] == [("layers.1", "Gate")]
    assert "tensor.item()" in fn.breaks[0].reason
    assert fn.breaks[0].where and "test_piecewise.py" in fn.breaks[0].where
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "graph break in layers.1 (Gate)" in warnings[0], warnings
    assert "tensor.item()" in warnings[0]


def test_a_module_running_eagerly_reports_what_its_pieces_did():
    """The root's own code runs eagerly and its pieces do the work: its stats count their captures, its
    last_capture is the graph that ran last (the head's), explain lists the pieces, guard_code finds the entry."""
    model = Net()
    fn = stampout.compile(model, backend="eager")
    fn(torch.randn(3, 4))
    fn(torch.randn(3, 4))
    assert fn.stats == stampout.CompileStats(captures=6, traces=0, reuses=0)  # embed, layers 0/2, inner, proj, head
    assert fn.pieces["layers.1"].stats.captures == 2 and fn.pieces["layers.1"]._counts.captures == 0
    assert fn.last_capture is fn.pieces["head"].last_capture is not None
    text = fn.explain()
    assert "stampout.compile of Net: 6 captures" in text and "(no compiled call yet)" not in text
    assert "  piece layers.1: runs eagerly" in text and "  piece layers.1.inner: compiled" in text
    assert fn.guard_code().startswith("# the full check") and "class of self: Linear" in fn.guard_code()


def test_user_visible_state_is_untouched():
    model = Net()
    before = {name: dict(vars(m)) for name, m in model.named_modules()}
    fn = stampout.compile(model, backend="eager")
    fn(torch.randn(3, 4))
    assert nn.Module.__call__ is nn.Module.__dict__["__call__"]
    assert nn.Module.__call__.__name__ == "_wrapped_call_impl"  # restored after the call
    for name, m in model.named_modules():
        assert set(vars(m)) == set(before[name]), name
    # the model called directly is eager PyTorch, not redirected
    torch.testing.assert_close(model(torch.ones(3, 4)), copy.deepcopy(model)(torch.ones(3, 4)))


def test_fullgraph_raises_and_capture_keeps_raising():
    model = Net()
    with pytest.raises(stampout.CaptureError, match=r"tensor.item\(\)") as info:
        stampout.capture(model, torch.randn(3, 4))
    fn = stampout.compile(model, backend="eager")
    fn.fullgraph = True  # what compile(..., fullgraph=True) sets
    with pytest.raises(stampout.CaptureError) as again:
        fn(torch.randn(3, 4))
    assert str(again.value) == str(info.value)


def test_explain_names_the_break():
    report = stampout.explain(Net(), torch.randn(3, 4))
    assert "graph break in layers.1 (Gate)" in report
    assert "tensor.item()" in report
    assert "layers.1.inner" not in report and "inner, proj" in report


def test_stampout_logs_breaks():
    root, breaks = logging.getLogger("stampout"), logging.getLogger("stampout.breaks")
    handlers = list(root.handlers)
    try:
        stampout._logging.configure("breaks")
        assert breaks.level == logging.INFO
    finally:
        breaks.setLevel(logging.NOTSET)
        root.handlers[:] = handlers


def test_function_that_cannot_be_captured_runs_eagerly():
    def f(x):
        return x * x.sum().item()

    fn = stampout.compile(f, backend="eager")
    x = torch.randn(3)
    torch.testing.assert_close(fn(x), f(x))
    assert [b.module_type for b in fn.breaks] == [f.__qualname__]


def test_threads_share_a_piecewise_model():
    model = Net()
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager")
    xs = [torch.randn(3, 4) * (i + 1) for i in range(8)]
    results: dict[int, torch.Tensor] = {}

    def work(i):
        results[i] = fn(xs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, x in enumerate(xs):
        torch.testing.assert_close(results[i], reference(x))
    assert nn.Module.__call__.__name__ == "_wrapped_call_impl"


@pytest.mark.slow
def test_qwen2_vl_compiles_around_its_vision_position_ids():
    """Qwen2-VL reads `grid_thw.tolist()` for its vision position ids: the vision tower's own code runs
    eagerly, its blocks and the language model are compiled."""
    pytest.importorskip("transformers")
    from zoo_models import qwen2_vl, qwen2_vl_inputs

    model = qwen2_vl()
    fn = stampout.compile(model, backend="aot_eager")
    with torch.no_grad():
        for extra in (0, 3):
            kwargs = qwen2_vl_inputs(extra)
            torch.testing.assert_close(fn(**kwargs).logits, model(**kwargs).logits)
    assert fn.breaks[0].module == "model.visual" and "tensor.item()" in fn.breaks[0].reason
    assert fn.pieces["model"].pieces["model.language_model"].stats.captures >= 1
    assert fn.pieces["lm_head"].stats.captures >= 1


class CheckpointedDropout(nn.Module):
    """Non-reentrant activation checkpointing: its RNG preservation (torch.get_rng_state) runs the module eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(lambda t: self.drop(self.a(t)), x, use_reentrant=False)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_children_under_activation_checkpointing_run_as_the_recomputation_runs_them(backend):
    """The backward recomputes the checkpointed children as plain modules: the forward runs them plainly too (was:
    compiled pieces in the forward, so torch raised CheckpointError on the dropout mask saved, or recomputed other
    values)."""
    torch.manual_seed(0)
    model = CheckpointedDropout()
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend=backend)
    for i in range(3):
        x = torch.randn(2, 4, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        torch.manual_seed(i)
        out = fn(x)
        out.sum().backward()
        torch.manual_seed(i)
        expected = reference(x_ref)
        expected.sum().backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(x.grad, x_ref.grad)
        torch.testing.assert_close(model.a.weight.grad, reference.a.weight.grad)
