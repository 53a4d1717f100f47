"""transformers' own state, watched as a user's with `config.watch_installed` (trace/code.is_user_file: installed
packages are user code): its output-capturing hooks under regions="auto" (they return 6 FakeTensors for 3 layers
while site-packages counts as library code: a venv's `platstdlib` holds site-packages) and its
ALL_ATTENTION_FUNCTIONS registry replaced after compiling (not seen). Without the switch (the default: it costs
~3x per call on HF models today) both stay wrong: strict xfails."""

from __future__ import annotations

import copy

import torch
import transformers

import pytest

import stampout

VOCAB = 128
_UNWATCHED_WRONG = pytest.mark.xfail(strict=True, reason="transformers' state is not watched without "
                                     "config.watch_installed")


@pytest.fixture(params=[pytest.param(False, marks=_UNWATCHED_WRONG), True], ids=["default", "watched"])
def watched(request):
    with stampout.config.patch(watch_installed=request.param):
        stampout.reset()
        yield request.param
    stampout.reset()


@pytest.fixture(params=[False, True], ids=["default", "watched"])
def either(request):
    with stampout.config.patch(watch_installed=request.param):
        stampout.reset()
        yield request.param
    stampout.reset()


def _llama(**kwargs) -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   **kwargs)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))


def test_attentions_collected_by_hooks_under_auto_regions_match_eager(watched):
    eager = _llama(attn_implementation="eager")
    compiled = stampout.compile(copy.deepcopy(eager).model, regions="auto", backend="eager")
    ids = _ids()
    for _ in range(2):
        with torch.no_grad():
            expected = eager.model(input_ids=ids, use_cache=False, output_attentions=True).attentions
            got = compiled(input_ids=ids, use_cache=False, output_attentions=True).attentions
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)


def test_attentions_collected_by_hooks_without_regions_match_eager(either):
    eager = _llama(attn_implementation="eager")
    compiled = stampout.compile(copy.deepcopy(eager).model, backend="eager")
    ids = _ids()
    for _ in range(2):
        with torch.no_grad():
            expected = eager.model(input_ids=ids, use_cache=False, output_attentions=True).attentions
            got = compiled(input_ids=ids, use_cache=False, output_attentions=True).attentions
        assert len(got) == len(expected) == 3
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)


def test_an_attention_function_replaced_after_compiling_is_seen(watched):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = _llama(attn_implementation="sdpa")
    compiled = stampout.compile(copy.deepcopy(eager), regions="auto", backend="eager")
    ids = _ids()

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits

    torch.testing.assert_close(logits(compiled), logits(eager))

    def doubled(module, q, k, v, mask, **kwargs):
        out, weights = sdpa_attention_forward(module, q, k, v, mask, **kwargs)
        return out * 2, weights

    ALL_ATTENTION_FUNCTIONS["sdpa"] = doubled
    try:
        torch.testing.assert_close(logits(compiled), logits(eager))
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
