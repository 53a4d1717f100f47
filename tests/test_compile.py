"""stampout.compile: guards on every call, exact recapture counts, never a stale entry."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from helpers import same
from test_divergent import Stack
from torch import nn

import stampout

GLOBAL_SCALE = 1.0


class UsesGlobal(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * GLOBAL_SCALE


def compiled_pair(n=4, backend="eager", dynamic=None):
    torch.manual_seed(0)
    model = Stack(n)
    return model, copy.deepcopy(model), stampout.compile(model, backend=backend, dynamic=dynamic)


def test_second_call_runs_without_capture():
    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    same(fn, reference, x)
    same(fn, reference, x)
    assert (fn.stats.captures, fn.stats.traces) == (1, 1)
    assert fn.last_capture.stats.reuses == 3


def test_input_shape_change_recaptures():
    model, reference, fn = compiled_pair()
    same(fn, reference, torch.randn(3, 8))
    same(fn, reference, torch.randn(5, 8))
    same(fn, reference, torch.randn(3, 8))  # the first entry again
    assert fn.stats.captures == 2


@pytest.mark.parametrize("n", [16, 80])
def test_eval_recaptures_with_one_region_trace(n):
    model, reference, fn = compiled_pair(n=n)
    x = torch.randn(3, 8)
    same(fn, reference, x)
    model.eval(), reference.eval()
    same(fn, reference, x)
    assert (fn.stats.captures, fn.stats.traces) == (2, 2)
    assert (fn.last_capture.stats.traces, fn.last_capture.stats.reuses) == (1, n - 1)
    model.train(), reference.train()
    same(fn, reference, x)
    assert fn.stats.captures == 2  # the training entry is still there


def test_attribute_change_recaptures():
    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    same(fn, reference, x)
    model.layers[2].scale = 3.0
    reference.layers[2].scale = 3.0
    same(fn, reference, x)
    assert fn.stats.captures == 2


def test_requires_grad_change_recaptures():
    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    same(fn, reference, x)
    model.layers[1].up.weight.requires_grad_(False)
    reference.layers[1].up.weight.requires_grad_(False)
    out = fn(x)
    assert fn.stats.captures == 2
    out.sum().backward()
    assert model.layers[1].up.weight.grad is None and model.layers[0].up.weight.grad is not None


def test_grad_mode_is_guarded():
    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    assert fn(x).requires_grad
    with torch.no_grad():
        assert not fn(x).requires_grad
    assert fn.stats.captures == 2


def test_weights_changed_in_place_need_no_recapture():
    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    same(fn, reference, x)
    with torch.no_grad():
        model.layers[0].up.weight.mul_(2)
        reference.layers[0].up.weight.mul_(2)
    same(fn, reference, x)
    assert fn.stats.captures == 1


def test_replaced_parameter_is_used():
    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    same(fn, reference, x)
    new = nn.Parameter(torch.randn(16, 8))
    model.layers[3].up.weight = new
    reference.layers[3].up.weight = nn.Parameter(new.detach().clone())
    same(fn, reference, x)


def test_hook_added_then_removed_is_never_stale():
    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    same(fn, reference, x)
    handle = model.layers[1].down.register_forward_hook(lambda m, i, o: o * 10)
    ref_handle = reference.layers[1].down.register_forward_hook(lambda m, i, o: o * 10)
    same(fn, reference, x)
    handle.remove()
    ref_handle.remove()
    same(fn, reference, x)
    assert fn.stats.captures == 2


def test_hook_present_at_compile_then_removed():
    torch.manual_seed(0)
    model = Stack(3)
    handle = model.layers[0].up.register_forward_hook(lambda m, i, o: o + 1)
    fn = stampout.compile(model, backend="eager")
    x = torch.randn(3, 8)
    with_hook = fn(x)
    handle.remove()
    torch.testing.assert_close(fn(x), model(x))
    assert not torch.allclose(with_hook, fn(x))


def test_global_change_recaptures():
    global GLOBAL_SCALE
    model = UsesGlobal()
    fn = stampout.compile(model, backend="eager")
    x = torch.randn(2, 8)
    try:
        torch.testing.assert_close(fn(x), model(x))
        GLOBAL_SCALE = 3.0
        torch.testing.assert_close(fn(x), model(x))
        assert fn.stats.captures == 2
    finally:
        GLOBAL_SCALE = 1.0


def test_a_failed_guard_never_runs_a_stale_entry():
    runs = []

    def backend(gm, example_inputs):
        index = len(runs)
        runs.append(0)

        def run(*args):
            runs[index] += 1
            return gm(*args)

        return run

    model, reference, fn = compiled_pair(backend=backend)
    x = torch.randn(3, 8)
    for change in range(4):
        same(fn, reference, x)
        model.layers[change].scale = 2.0 + change
        reference.layers[change].scale = 2.0 + change
        same(fn, reference, x)
    assert runs[-1] == 1 and len(runs) == fn.stats.captures == 5


def test_python_side_effects_are_replayed_on_every_call():
    class Counts(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.calls = 0
            self.seen = []

        def forward(self, x):
            self.calls = self.calls + 1
            h = self.lin(x)
            self.last = h * 2  # a tensor stored on the module: an extra output of the graph
            self.seen.append(self.calls)
            return h

    model = Counts()
    fn = stampout.compile(model, backend="eager")
    for i in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(fn(x), model.lin(x))
        assert model.calls == i + 1 and model.seen == list(range(1, i + 2))
        assert type(model.last) is torch.Tensor
        torch.testing.assert_close(model.last, model.lin(x) * 2)


def test_python_side_effect_that_cannot_be_replayed_runs_eagerly_not_dropped(caplog):
    class Keeps(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            self.made = object()  # an object made during the call: not replayable
            return self.lin(x)

    model = Keeps()
    fn = stampout.compile(model, backend="eager")
    with caplog.at_level(logging.WARNING, logger="stampout.guards"):
        for _ in range(2):
            before = getattr(model, "made", None)
            x = torch.randn(2, 4)
            torch.testing.assert_close(fn(x), model.lin(x))
            assert type(model.made) is object and model.made is not before  # (each call stores its own, as eager)
    assert "stores a object made during the call" in caplog.text and "test_compile.py" in caplog.text
    with pytest.raises(stampout.CaptureError, match=r"stores a object made during the call"):
        stampout.compile(Keeps(), backend="eager", fullgraph=True)(torch.randn(2, 4))


def test_guard_failure_is_logged(caplog):
    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    fn(x)
    model.layers[1].norm.eps = 0.1
    with caplog.at_level(logging.INFO, logger="stampout.guards"):
        fn(x)
    assert "self.layers[1].norm.eps" in caplog.text and "0.1" in caplog.text


def test_compile_leaves_module_classes_usable():
    model, reference, fn = compiled_pair()
    fn(torch.randn(3, 8))
    assert isinstance(model.layers[0], nn.Module)
    stampout.reset()
    assert type(model.layers[0]).__dict__.get("_stampout_original") is None


def test_max_entries_drops_the_oldest():
    model, reference, fn = compiled_pair(dynamic=False)  # a capture per shape
    fn.max_entries = 2
    for n in (1, 2, 3, 1):
        same(fn, reference, torch.randn(n, 8))
    assert fn.stats.captures == 4


def test_two_compiled_functions_over_shared_modules_both_guard():
    torch.manual_seed(0)
    model = Stack(3)
    reference = copy.deepcopy(model)
    whole = stampout.compile(model, backend="eager")
    part = stampout.compile(model.layers[1], backend="eager")
    x = torch.randn(3, 8)
    same(whole, reference, x)  # model is now write-watched by `whole`
    torch.testing.assert_close(part(x), reference.layers[1](x))  # capture while `whole` watches
    model.layers[1].scale = 4.0
    reference.layers[1].scale = 4.0
    torch.testing.assert_close(part(x), reference.layers[1](x))
    same(whole, reference, x)
    assert (part.stats.captures, whole.stats.captures) == (2, 2)


def test_releasing_one_compiled_function_keeps_the_other_watching():
    torch.manual_seed(0)
    model = Stack(3)
    reference = copy.deepcopy(model)
    whole = stampout.compile(model, backend="eager")
    part = stampout.compile(model.layers[1], backend="eager")
    x = torch.randn(3, 8)
    part(x)
    same(whole, reference, x)
    part.reset()  # releases its watch on layers[1]; `whole` still guards it
    model.layers[1].scale = 5.0
    reference.layers[1].scale = 5.0
    same(whole, reference, x)
    assert whole.stats.captures == 2


def test_module_without_training_dependent_code_does_not_recapture_on_eval():
    from stampout.tools.models import LlamaConfig, LlamaLike

    model = LlamaLike(LlamaConfig(layers=4), regions=True)
    fn = stampout.compile(model, backend="eager")
    ids = torch.randint(0, 128, (2, 8))
    fn(ids)
    model.eval()
    torch.testing.assert_close(fn(ids), model(ids))
    assert fn.stats.captures == 1  # nothing the capture read depends on `training`


def test_recaptures_over_time_do_not_hit_the_region_entry_cap():
    model, reference, fn = compiled_pair(n=3, dynamic=False)
    for batch in range(1, 12):  # 11 input shapes: more than max_reuse_entries=8 region traces in all
        same(fn, reference, torch.randn(batch, 8))
    assert fn.stats.captures == 11 and fn.stats.traces == 11
    assert fn.last_capture.stats.traces == 1


def _hf_model(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "llama":  # slices its ModuleList in forward
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        model = transformers.LlamaForCausalLM(config).eval()
        layers = model.model.layers
    else:  # ties lm_head.weight to the token embedding
        config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=128, n_positions=32)
        model = transformers.GPT2LMHeadModel(config).eval()
        layers = model.transformer.h
    for layer in layers:
        stampout.region(layer)
    return model


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hugging_face_models_compile_once_and_stay_guarded(name):
    model = _hf_model(name)
    fn = stampout.compile(model, backend="eager")
    ids = torch.randint(0, 128, (2, 8))
    for _ in range(3):
        torch.testing.assert_close(fn(input_ids=ids, use_cache=False).logits,
                                   model(input_ids=ids, use_cache=False).logits)
    assert (fn.stats.captures, fn.stats.traces) == (1, 1)
    assert fn.last_capture.stats.reuses == 2


def test_unrelated_module_construction_does_not_invalidate_guards():
    from stampout.watch.tracking import EPOCH

    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    fn(x)
    before = EPOCH.value
    torch.nn.Linear(2, 2)  # registers parameters on a module nobody watches
    assert EPOCH.value == before
    model.layers[0].register_buffer("extra", torch.zeros(1))  # a watched module: guards must re-check
    assert EPOCH.value > before
    same(fn, reference, x)
