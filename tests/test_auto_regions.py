"""regions="auto": repeated children of ModuleLists and Sequentials become regions without code changes."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_matches_eager

import stampout
from stampout.tools.models import LlamaConfig, LlamaLike


def test_auto_regions_marks_repeated_layers_for_the_capture_only():
    model = LlamaLike(LlamaConfig(layers=6), regions=False)
    ids = torch.randint(0, 128, (2, 8))
    with stampout.auto_regions(model) as marked:
        cap = assert_matches_eager(model, ids, grad=True)
    assert marked == [f"layers.{i}" for i in range(6)]
    assert (cap.stats.traces, cap.stats.reuses, cap.stats.subgraphs) == (1, 5, 1)
    assert all("forward" not in layer.__dict__ for layer in model.layers)  # unmarked again
    assert stampout.capture(model, ids).stats.traces == 0


def test_compile_with_auto_regions():
    torch.manual_seed(0)
    model = LlamaLike(LlamaConfig(layers=8), regions=False)
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager", regions="auto")
    ids = torch.randint(0, 128, (2, 8))
    torch.testing.assert_close(fn(ids), reference(ids))
    torch.testing.assert_close(fn(ids), reference(ids))
    assert (fn.stats.captures, fn.stats.traces) == (1, 1)
    assert fn.last_capture.stats.reuses == 7


def test_hugging_face_model_with_auto_regions():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=128, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 128, (2, 8))
    with stampout.auto_regions(model) as marked:
        cap = stampout.capture(model, input_ids=ids, use_cache=False)
    assert marked == [f"transformer.h.{i}" for i in range(4)]
    assert (cap.stats.traces, cap.stats.reuses) == (1, 3)
    with torch.no_grad():
        torch.testing.assert_close(cap(input_ids=ids, use_cache=False).logits,
                                   model(input_ids=ids, use_cache=False).logits)


def test_bad_regions_option_is_a_clear_error():
    with pytest.raises(stampout.StampoutError, match="regions must be None or 'auto'"):
        stampout.compile(torch.nn.Linear(2, 2), regions="all")
