"""Training through what torch's AOTAutograd refuses: regions that write their inputs (BatchNorm's running stats)
are inlined for it; a backend that fails on a symbolic capture gets a static one instead (one capture per size)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from helpers import named_grads, tree_assert_close
from torch import nn

import stampout


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))) + x


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x):
        return self.blocks(x)


class Net(nn.Module):
    """Stages of blocks: regions inside regions, each writing BatchNorm's running stats in training."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stages = nn.ModuleList([Stage(), Stage()])

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return x.mean((2, 3))


def _train_step(fn, model, reference, x):
    out, expected = fn(x), reference(x)
    tree_assert_close(out, expected)
    out.square().mean().backward()
    expected.square().mean().backward()
    tree_assert_close(named_grads(model), named_grads(reference), check_requires_grad=False)
    tree_assert_close(dict(model.named_buffers()), dict(reference.named_buffers()))
    model.zero_grad()
    reference.zero_grad()


@pytest.mark.parametrize("regions", ["auto", None])
def test_batchnorm_regions_train_with_aot_eager(regions):
    model = Net().train()
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="aot_eager", regions=regions)
    for size in (6, 8, 6):
        _train_step(fn, model, reference, torch.randn(2, 4, size, size))
    assert fn.stats.captures == 2
    if regions:
        stats = fn.last_capture.stats
        assert (stats.traces, stats.reuses) == (2, 2)  # a stage (reused once) and its block (reused once)


def test_batchnorm_regions_are_inlined_only_for_training():
    from stampout.backends.inline import inline_writing_regions
    from stampout.backends.runner import as_call_modules

    model = Net().train()
    with stampout.auto_regions(model):
        cap = stampout.capture(model, torch.randn(2, 4, 6, 6))
    example = cap.placeholders_for((torch.randn(2, 4, 6, 6),), {})
    with torch.no_grad():
        assert inline_writing_regions(copy.deepcopy(cap.gm), example) == 0
    gm = copy.deepcopy(cap.gm)
    assert inline_writing_regions(gm, example) == 6  # two stages, then the two blocks each brought along
    assert [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph] == []
    tree_assert_close(gm(*example), as_call_modules(cap.gm)(*example))


def test_backend_failing_on_symbolic_sizes_gets_static_captures(caplog):
    seen = []

    def static_only(gm, example_inputs):
        symbolic = any(isinstance(s, torch.SymInt) for t in example_inputs if isinstance(t, torch.Tensor)
                       for s in t.shape)
        seen.append(symbolic)
        if symbolic:
            raise RuntimeError("this backend takes static shapes only")
        return gm

    lin = nn.Linear(4, 4)
    fn = stampout.compile(lin, backend=static_only)
    with caplog.at_level(logging.WARNING, logger="stampout"):
        for n in (3, 5, 7, 5):
            x = torch.randn(n, 4)
            tree_assert_close(fn(x), lin(x))
    assert seen == [False, True, False, False]  # the symbolic capture is not tried again
    assert fn.stats.captures == 4
    assert any("failed on the symbolic capture" in r.getMessage() for r in caplog.records)
