"""Generation with Hugging Face decoders (transformers 5): KV caches as inputs and outputs of captured and
compiled calls, `model.generate` through `stampout.compile`, and MoE models (which take their compile paths
because `torch.compiler.is_compiling()` is true on the capturing thread). Everything is compared with eager:
tokens, per-step logits, and the caller's cache objects after each call."""

from __future__ import annotations

import threading

import pytest
import torch

import stampout

transformers = pytest.importorskip("transformers")
from generation_models import MODELS, PROMPT, VOCAB, build  # noqa: E402
from generation_models import assert_same_generation as _assert_same_generation  # noqa: E402
from generation_models import greedy as _generate  # noqa: E402


def _compiled_forward(model, backend: str = "eager"):
    model.forward = stampout.compile(model.forward, backend=backend, regions="auto")
    captures: list = []
    recapture = model.forward._recapture

    def recorded(*args, **kwargs):
        hit = recapture(*args, **kwargs)
        captures.append(hit[0].capture)
        return hit

    model.forward._recapture = recorded
    model.forward.captures = captures  # every Capture it made, for per-capture region counts
    return model.forward


# Region traces of the decoder layer per capture: one for all layers (each layer finds its cache entry through
# `cache.layers[self.self_attn.layer_idx]`, a per-call source); Gemma-2 alternates sliding and full layers.
LAYER_TRACES = {"gemma2": 2}


def _assert_one_trace_per_capture(fn, name: str, layers: int = 3) -> None:
    for cap in fn.captures:
        stats = cap.stats
        assert stats.traces + stats.dedups <= LAYER_TRACES.get(name, 1), (name, stats)
        assert stats.traces + stats.dedups + stats.reuses == layers


# Prefill and decode: one capture each, reused by every later step and generate call (Gemma-2's sliding-window
# layers keep their position as a Python int: captured as a symbolic int from the first decode step on).
STATIC_CAPTURES: dict[str, int] = {}


@pytest.mark.parametrize("name", MODELS)
def test_generate_static_cache_matches_eager(name):
    model = build(name)
    expected = _generate(model, "static")
    fn = _compiled_forward(model)
    _assert_same_generation(_generate(model, "static"), expected)
    captures = fn.stats.captures
    assert captures == STATIC_CAPTURES.get(name, 2)
    _assert_same_generation(_generate(model, "static"), expected)
    assert fn.stats.captures == captures  # the second generate call captures nothing
    _assert_one_trace_per_capture(fn, name)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_generate_static_cache_deeper_than_the_reuse_limit(name):
    """12 layers, more than a region's max_reuse_entries (8): the per-layer index is not a constant, so every
    layer stamps out the one trace instead of needing an entry of its own."""
    model = build(name, layers=12)
    expected = _generate(model, "static")
    fn = _compiled_forward(model)
    _assert_same_generation(_generate(model, "static"), expected)
    _assert_one_trace_per_capture(fn, name, layers=12)


@pytest.mark.parametrize("name", MODELS)
def test_generate_dynamic_cache_matches_eager(name):
    model = build(name)
    expected = _generate(model, "dynamic")
    fn = _compiled_forward(model)
    _assert_same_generation(_generate(model, "dynamic"), expected)
    # prefill, the first decode step, then one capture with the cache's length symbolic for every later step
    captures = fn.stats.captures
    assert captures == 3
    _assert_same_generation(_generate(model, "dynamic"), expected)
    assert fn.stats.captures == captures  # the second generate call captures nothing
    _assert_one_trace_per_capture(fn, name)


@pytest.mark.inductor
def test_generate_static_cache_inductor():
    model = build("llama", layers=2)
    expected = _generate(model, "static")
    fn = _compiled_forward(model, backend="inductor")
    _assert_same_generation(_generate(model, "static"), expected)
    _assert_same_generation(_generate(model, "static"), expected)
    assert fn.stats.captures == 2


# ---------------------------------------------------------------------------- caches as inputs and outputs
def _cache(kind: str, config):
    if kind == "dynamic":
        return transformers.DynamicCache(config=config)
    return transformers.StaticCache(config=config, max_cache_len=16)


def _assert_same_cache(got, expected) -> None:
    """Every attribute of every cache layer as eager leaves it: tensors (real ones) and Python values."""
    assert len(got.layers) == len(expected.layers)
    for i, (a, b) in enumerate(zip(got.layers, expected.layers)):
        assert type(a) is type(b) and sorted(vars(a)) == sorted(vars(b)), i
        for key, y in vars(b).items():
            x = vars(a)[key]
            if isinstance(y, torch.Tensor):
                assert type(x) is torch.Tensor, f"layers[{i}].{key} is a {type(x).__name__}"
                torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
            else:
                assert x == y, (i, key, x, y)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_capture_with_cache_input_and_output(kind):
    model = build("llama")
    step = torch.randint(0, VOCAB, (1, 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        eager_cache = _cache(kind, model.config)
        e1 = model(input_ids=PROMPT, past_key_values=eager_cache, use_cache=True)
        e1_logits = e1.logits.clone()
        captured_cache = _cache(kind, model.config)
        cap = stampout.capture(model, input_ids=PROMPT, past_key_values=captured_cache, use_cache=True)
        _assert_same_cache(captured_cache, eager_cache)  # capture ran the program once, as eager does

        call_cache = _cache(kind, model.config)
        out = cap(input_ids=PROMPT, past_key_values=call_cache, use_cache=True)
        assert out.past_key_values is call_cache  # the call's own cache object, with real tensors
        torch.testing.assert_close(out.logits, e1_logits)
        _assert_same_cache(call_cache, eager_cache)

        e2 = model(input_ids=step, past_key_values=eager_cache, use_cache=True)
        cap2 = stampout.capture(model, input_ids=step, past_key_values=captured_cache, use_cache=True)
        _assert_same_cache(captured_cache, eager_cache)
        out2 = cap2(input_ids=step, past_key_values=call_cache, use_cache=True)
        torch.testing.assert_close(out2.logits, e2.logits)
        _assert_same_cache(call_cache, eager_cache)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_compile_with_cache_input_and_output(kind):
    model = build("llama")
    fn = stampout.compile(model, backend="eager", regions="auto")
    steps = [PROMPT] + [torch.randint(0, VOCAB, (1, 1), generator=torch.Generator().manual_seed(s))
                        for s in range(3)]
    with torch.no_grad():
        eager_cache, compiled_cache = _cache(kind, model.config), _cache(kind, model.config)
        for ids in steps:
            expected = model(input_ids=ids, past_key_values=eager_cache, use_cache=True)
            got = fn(input_ids=ids, past_key_values=compiled_cache, use_cache=True)
            assert got.past_key_values is compiled_cache
            torch.testing.assert_close(got.logits, expected.logits)
            _assert_same_cache(compiled_cache, eager_cache)
    # dynamic: prefill, the first decode step, then one symbolic capture for the growing cache
    assert fn.stats.captures == (2 if kind == "static" else 3)


def test_cache_that_grows_its_layer_list_is_refused_or_run_eagerly_not_wrong():
    """`DynamicCache()` without a config appends its layers during the call: the capture leaves real tensors in
    the capture's own cache, and calls that cannot repeat the change raise (capture) or run eagerly (compile) instead of
    returning a stale cache."""
    model = build("llama")
    with torch.no_grad():
        cache = transformers.DynamicCache()
        cap = stampout.capture(model, input_ids=PROMPT, past_key_values=cache, use_cache=True)
        assert len(cache.layers) == 3 and all(type(layer.keys) is torch.Tensor for layer in cache.layers)
        with pytest.raises(stampout.StampoutError, match="changes the items of past_key_values.layers"):
            cap(input_ids=PROMPT, past_key_values=transformers.DynamicCache(), use_cache=True)
        fn = stampout.compile(model, backend="eager")  # (it cannot make the layers again: the call runs eagerly)
        eager_cache, compiled_cache = transformers.DynamicCache(), transformers.DynamicCache()
        expected = model(input_ids=PROMPT, past_key_values=eager_cache, use_cache=True)
        got = fn(input_ids=PROMPT, past_key_values=compiled_cache, use_cache=True)
        torch.testing.assert_close(got.logits, expected.logits)
        _assert_same_cache(compiled_cache, eager_cache)
        assert fn.explain().count("DynamicLayer made during the call") >= 1


def test_static_cache_of_another_size_recaptures():
    model = build("llama")
    fn = stampout.compile(model, backend="eager")
    with torch.no_grad():
        for length in (16, 24, 16):
            eager_cache = transformers.StaticCache(config=model.config, max_cache_len=length)
            compiled_cache = transformers.StaticCache(config=model.config, max_cache_len=length)
            expected = model(input_ids=PROMPT, past_key_values=eager_cache, use_cache=True)
            got = fn(input_ids=PROMPT, past_key_values=compiled_cache, use_cache=True)
            torch.testing.assert_close(got.logits, expected.logits)
            _assert_same_cache(compiled_cache, eager_cache)
    assert fn.stats.captures == 2


# ---------------------------------------------------------------------------- MoE and is_compiling
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_capture_and_compile_match_eager(name):
    model = build(name)
    with torch.no_grad():
        expected = model(input_ids=PROMPT, use_cache=False).logits
        cap = stampout.capture(model, input_ids=PROMPT, use_cache=False)
        cap.gm.graph.lint()
        torch.testing.assert_close(cap(input_ids=PROMPT, use_cache=False).logits, expected)
        fn = stampout.compile(model, backend="eager", regions="auto")
        torch.testing.assert_close(fn(input_ids=PROMPT, use_cache=False).logits, expected)
    assert fn.stats.traces == 1 and fn.last_capture.stats.reuses == 2


def test_is_compiling_only_on_the_capturing_thread():
    seen_inside: list[bool] = []
    seen_elsewhere: list[bool] = []
    inside = threading.Event()
    checked = threading.Event()

    def other_thread():
        inside.wait(10)
        seen_elsewhere.append(torch.compiler.is_compiling())
        checked.set()

    def program(x):
        seen_inside.append(torch.compiler.is_compiling())
        inside.set()
        checked.wait(10)
        return x * 2

    original = torch.compiler.is_compiling
    thread = threading.Thread(target=other_thread)
    thread.start()
    cap = stampout.capture(program, torch.ones(3))
    thread.join()
    assert seen_inside == [True] and seen_elsewhere == [False]
    assert torch.compiler.is_compiling() is False
    assert torch.compiler.is_compiling is original  # restored
    torch.testing.assert_close(cap(torch.ones(3)), torch.full((3,), 2.0))
