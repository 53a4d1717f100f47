"""`stampout.compile`'s three modes over changing sizes: `dynamic=None` (static, then one symbolic capture),
`dynamic=True` (training), `dynamic=False` (per shape), `mark_dynamic`, the recapture log; symbolic graphs under
aot_eager and Inductor, and Hugging Face models over sequence lengths."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from dynamic_models import LENGTHS, Stack, dynamic_input
from helpers import tree_assert_close
from torch import nn

import stampout
from stampout.tools.models import make_input, make_model


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_dynamic_none_captures_twice_over_eight_lengths(backend):
    """Under aot_eager the calls run without grad: its static, sequence-symbolic and batch-and-sequence-symbolic
    graphs are inference graphs (a symbolic training graph costs AOTAutograd's joint trace and partition, 3x the
    time); the symbolic training graphs through aot_eager are test_dynamic_true_captures_once_and_trains' (a
    symbolic sequence and batch) and zoo_checks.check_trains' (dynamic=None's second size, Hugging Face models)."""
    model = make_model("llama", regions=True, layers=2)
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend=backend)
    with torch.set_grad_enabled(backend == "eager"):
        for i, t in enumerate(LENGTHS):
            (ids,) = make_input("llama", seq=t, model=model, seed=i)
            tree_assert_close(fn(ids), reference(ids))
            assert fn.last_capture.stats.traces == 1  # the repeated layer traced once per capture
        assert fn.stats.captures == 2
        for b in (3, 5):  # a second batch size: one more capture, symbolic in both dims
            (ids,) = make_input("llama", batch=b, seq=7, model=model)
            tree_assert_close(fn(ids), reference(ids))
        assert fn.stats.captures == 3


def test_dynamic_true_captures_once_and_trains():
    model = make_model("llama", regions=True, layers=2)
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="aot_eager", dynamic=True)
    batches = (2, 2, 2, 2, 3)  # (the last: another batch size, the same symbolic training graph)
    for i, (b, t) in enumerate(zip(batches, LENGTHS[:5])):
        (ids,) = make_input("llama", batch=b, seq=t, model=model, seed=i)
        out, ref = fn(ids), reference(ids)
        tree_assert_close(out, ref)
        out.square().mean().backward()
        ref.square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name, rtol=1e-4, atol=1e-5)
    assert fn.stats.captures == 1 and fn.stats.traces == 1


def test_dynamic_false_captures_per_shape():
    model = Stack(2)
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager", dynamic=False)
    for t in (8, 12, 8, 5, 12):
        x = torch.randn(2, t, 16)
        tree_assert_close(fn(x), reference(x))
    assert fn.stats.captures == 3
    assert fn.last_capture.shapes is None


def test_mark_dynamic_captures_once():
    model = Stack(3)
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager", dynamic=False)
    for t in (8, 12, 5, 20):
        x = dynamic_input(t)
        tree_assert_close(fn(x), reference(x))
    assert fn.stats.captures == 1


def test_recapture_log_names_the_dim(caplog):
    fn = stampout.compile(Stack(2), backend="eager")
    fn(torch.randn(2, 8, 16))
    with caplog.at_level(logging.INFO, logger="stampout.guards"):
        fn(torch.randn(2, 12, 16))
    assert "changed size in dim [1]" in caplog.text and "[2, 8, 16] -> [2, 12, 16]" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="stampout.guards"):
        fn(torch.randn(2, 1, 16))  # outside the symbolic capture (1 is specialized)
    assert "the symbolic capture assumed" in caplog.text


def test_gradients_equal_eager_for_every_length():
    model = Stack(3)
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager", dynamic=True)
    for t in (6, 9, 14):
        x = torch.randn(2, t, 16, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        out, ref = fn(x)[0], reference(xr)[0]
        tree_assert_close(out, ref)
        out.sum().backward()
        ref.sum().backward()
        torch.testing.assert_close(x.grad, xr.grad)
    assert fn.stats.captures == 1


@pytest.mark.inductor
def test_inductor_compiles_once_for_all_lengths():
    model = make_model("llama", regions=True, layers=2, hidden=32, intermediate=64)
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="inductor", dynamic=True)
    for i, t in enumerate((8, 13, 21)):
        (ids,) = make_input("llama", seq=t, model=model, seed=i)
        tree_assert_close(fn(ids), reference(ids), rtol=1e-4, atol=1e-4)
    assert fn.stats.captures == 1


@pytest.mark.inductor
def test_inductor_a_new_length_compiles_each_distinct_region_once_more_as_one_cpp_module(monkeypatch):
    """dynamic=None: the second length recaptures with the sequence symbolic, and that compiles the one distinct
    region once more, with the C++ wrapper (one C++ module serving every later length, not a Python wrapper with
    a module per kernel), in the background, lowering included (the second length's call runs eagerly meanwhile;
    Inductor assumes nothing about the sizes beyond the capture's guards); the third length
    compiles nothing and is served by that module. Values are eager's throughout."""
    from torch._dynamo.utils import counters

    from stampout.backends import background, inductor

    patches = []
    config_patches = inductor._config_patches

    def recorded(gm, example_inputs):
        patches.append(config_patches(gm, example_inputs))
        return patches[-1]

    monkeypatch.setattr(inductor, "_config_patches", recorded)
    model = make_model("llama", regions=True, layers=2, hidden=32, intermediate=64)
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="inductor")

    def graphs():
        return counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"]

    compiled = []
    stats, lowering = dict(background.STATS), dict(background.LOWERING_STATS)
    for i, t in enumerate((8, 13, 21)):
        before = graphs()
        (ids,) = make_input("llama", seq=t, model=model, seed=i)
        with torch.no_grad():
            tree_assert_close(fn(ids), reference(ids), rtol=1e-4, atol=1e-4)
        background.wait_all()
        compiled.append(graphs() - before)
    assert fn.stats.captures == 2 and compiled == [1, 1, 0]
    assert {k: background.STATS[k] - stats[k] for k in stats} == {"deferred": 1, "ready": 1, "failed": 0}
    assert {k: background.LOWERING_STATS[k] - lowering[k] for k in lowering} == {"lowered": 1, "assumed_more": 0}
    assert [p.get("cpp_wrapper") for p in patches] == [True, True]  # (the static region's, the symbolic one's)


def test_a_symbolic_graph_reaches_the_cpp_wrapper_without_input_values_and_falls_back_when_it_fails():
    """compile_fx with the C++ wrapper reads a graph's inputs from its placeholders' `val` and turns symbolic sizes
    into None: a symbolic graph goes without them (and keeps them for the Python wrapper); a failure before the
    inner compile falls back to the Python wrapper."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from stampout.backends import inductor
    from stampout.torch_internals import FakeTensorMode

    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        x = torch.empty(2, env.create_unbacked_symint() + 3)
    gm = torch.fx.symbolic_trace(lambda t: (t.sin(),))
    for node in gm.graph.nodes:
        node.meta["val"] = x if node.op == "placeholder" else (x,)
    calls = []

    def compile_fx(graph, example_inputs, config_patches=None, **kwargs):
        values = [n.meta.get("val") is not None for n in graph.graph.nodes if n.op == "placeholder"]
        calls.append((bool((config_patches or {}).get("cpp_wrapper")), values))
        if config_patches and config_patches.get("cpp_wrapper"):
            raise TypeError("view() received an invalid combination of arguments")
        return "compiled"

    assert inductor._compile_fx(compile_fx, gm, [x], "region r", {"cpp_wrapper": True}) == "compiled"
    assert calls == [(True, [False]), (False, [True])]
    assert inductor._compile_fx(compile_fx, gm, [torch.randn(2, 3)], "region r", {}) == "compiled"
    assert calls[-1] == (False, [True])


def _hf(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "llama":
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return transformers.LlamaForCausalLM(config).eval()
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=128, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hugging_face_variable_sequence_length(name):
    model = _hf(name)
    fn = stampout.compile(model, backend="eager", regions="auto")
    for i, t in enumerate((8, 12, 5, 16, 9)):
        ids = torch.randint(0, 128, (2, t), generator=torch.Generator().manual_seed(i))
        mask = torch.ones(2, t, dtype=torch.long)
        mask[0, : i % 3] = 0  # left padding in the first row
        with torch.no_grad():
            out = fn(ids, attention_mask=mask, use_cache=False).logits
            ref = model(ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(out, ref)
        assert fn.last_capture.stats.traces == 1
    assert fn.stats.captures == 2
