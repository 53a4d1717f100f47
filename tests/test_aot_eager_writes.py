"""aot_eager: a region call that writes its inputs in place (a static KV cache) runs as plain in-place writes on
the graph inputs, not as an `auto_functionalized` subgraph that clones and copies back every call."""

from __future__ import annotations

import pytest
import torch

import stampout
import stampout.backends.aot_eager as aot_eager
from tests.test_backends import CacheStack

_AUTO_FUNCTIONALIZED = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)


def _run(monkeypatch) -> list:
    graphs = []
    nop = aot_eager._boxed_nop

    def recording(gm, example_inputs):
        graphs.append(gm)
        return nop(gm, example_inputs)

    monkeypatch.setattr(aot_eager, "_boxed_nop", recording)
    model = CacheStack()
    caches, expected_caches = [torch.zeros(2, 6, 8) for _ in range(3)], [torch.zeros(2, 6, 8) for _ in range(3)]
    fn = stampout.compile(model, backend="aot_eager")
    for step in range(3):
        x, pos = torch.randn(2, 1, 8), torch.tensor([step])
        with torch.no_grad():
            got, expected = fn(x, caches, pos), model(x, expected_caches, pos)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        for a, b in zip(caches, expected_caches):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert fn.stats.captures == 1
    return graphs


def test_cache_writes_are_in_place_on_the_graph_inputs(monkeypatch):
    graphs = _run(monkeypatch)
    assert graphs
    for gm in graphs:
        for module in gm.modules():
            for node in getattr(module, "graph", torch.fx.Graph()).nodes:
                assert node.target not in _AUTO_FUNCTIONALIZED, node.format_node()
                assert node.target is not torch.ops.higher_order.invoke_subgraph


def test_hf_static_cache_generation_under_aot_eager_matches_eager(monkeypatch):
    pytest.importorskip("transformers")
    from generation_models import assert_same_generation, build, greedy

    graphs = []
    nop = aot_eager._boxed_nop
    monkeypatch.setattr(aot_eager, "_boxed_nop", lambda gm, ex: (graphs.append(gm), nop(gm, ex))[1])
    model = build("llama")
    expected = greedy(model, "static")
    model.forward = stampout.compile(model.forward, backend="aot_eager", regions="auto")
    assert_same_generation(greedy(model, "static"), expected)
    assert_same_generation(greedy(model, "static"), expected)
    assert model.forward.stats.captures == 2  # prefill and decode
    assert graphs and not any(node.target in _AUTO_FUNCTIONALIZED for gm in graphs for module in gm.modules()
                              for node in getattr(module, "graph", torch.fx.Graph()).nodes)
