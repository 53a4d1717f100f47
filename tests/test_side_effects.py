"""Python side effects inside regions: never skipped by stamping, never hidden in outputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout


class Appends(nn.Module):
    def __init__(self, log):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log = log

    @stampout.region
    def forward(self, x):
        y = self.lin(x)
        self.log.append(y)
        return y


class Writes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.last = None

    @stampout.region
    def forward(self, x):
        self.last = x.shape[0]
        return self.lin(x)


def test_region_appending_to_a_list_is_traced_every_time():
    log = []
    model = nn.Sequential(Appends(log), Appends(log), Appends(log))
    cap = stampout.capture(model, torch.randn(2, 4))
    assert cap.stats.traces + cap.stats.dedups == 3 and cap.stats.reuses == 0  # each call ran its Python
    assert len(log) == 3
    assert "in place" in cap.events[0].ineligible


def test_region_writing_an_attribute_is_repeated_by_stamped_calls():
    """A constant or tensor stored on an object the region can name is stored again by each stamped call
    (on that call's object), so the Python state after the capture is what eager leaves."""
    model = nn.Sequential(Writes(), Writes(), Writes())
    cap = stampout.capture(model, torch.randn(2, 4))
    assert cap.stats.traces == 1 and cap.stats.reuses == 2
    assert all(layer.last == 2 for layer in model)
    x = torch.randn(2, 4)
    torch.testing.assert_close(cap(x), model(x))


class StoresAnObject(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @stampout.region
    def forward(self, x):
        self.note = {"rows": x.shape[0]}  # an object made during the call: a stamped call could not repeat it
        return self.lin(x)


def test_region_storing_an_object_it_made_is_traced_every_time():
    model = nn.Sequential(StoresAnObject(), StoresAnObject(), StoresAnObject())
    cap = stampout.capture(model, torch.randn(2, 4))
    assert cap.stats.traces + cap.stats.dedups == 3 and cap.stats.reuses == 0
    assert all(layer.note == {"rows": 2} for layer in model)
    assert "stores a dict on self.note" in cap.events[1].ineligible


class Cache:
    def __init__(self):
        self.layers = []


class UsesCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @stampout.region
    def forward(self, x, cache):
        y = self.lin(x)
        cache.layers.append(y)
        return y


def test_object_holding_traced_tensors_in_the_output_is_refused():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([UsesCache(), UsesCache()])

        def forward(self, x):
            cache = Cache()
            for block in self.blocks:
                x = block(x, cache)
            return x, cache

    with pytest.raises(stampout.CaptureError, match="Cache whose .layers carries traced tensors"):
        stampout.capture(Model(), torch.randn(2, 4))


class Box:
    pass


def test_an_output_object_holding_traced_tensors_in_a_dict_is_refused():
    # The check looked into an output object's attributes, their list or tuple items and those items' attributes,
    # not into a dict: `box.by_name["k"]` came back to the caller as a FakeTensor.
    def fn(x):
        box = Box()
        box.by_name = {"k": x * 2}
        return x + 1, box

    with pytest.raises(stampout.CaptureError, match="Box whose .by_name carries traced tensors"):
        stampout.capture(fn, torch.randn(3))


def test_hugging_face_kv_cache_is_refused_not_wrong():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config).eval()
    for layer in model.model.layers:
        stampout.region(layer)
    with pytest.raises(stampout.CaptureError, match="use_cache=False"):
        stampout.capture(model, input_ids=torch.randint(0, 128, (1, 4)), use_cache=True)


class ReadsDict(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.opts = {"scale": scale, "proj": nn.Identity()}

    @stampout.region
    def forward(self, x):
        return self.opts["proj"](self.lin(x)) * self.opts["scale"]


def test_dict_attribute_items_are_guarded_one_by_one():
    model = nn.Sequential(ReadsDict(2.0), ReadsDict(2.0), ReadsDict(3.0))
    cap = stampout.capture(model, torch.randn(2, 4))
    assert [e.outcome for e in cap.events] == ["traced", "reused", "traced"]
    assert "self.opts['scale']" in cap.events[2].reason
    x = torch.randn(2, 4)
    torch.testing.assert_close(cap(x), model(x))


@stampout.region
def transposes_in_place(x):
    x.t_()
    return x * 2


def test_region_changing_input_metadata_in_place_is_traced_every_time():
    def prog(x):
        a, b = x.clone(), x.clone()
        return transposes_in_place(a) + transposes_in_place(b)

    x = torch.randn(2, 3)
    cap = stampout.capture(prog, x)
    assert cap.stats.reuses == 0
    assert "metadata of its input" in cap.events[0].ineligible
    torch.testing.assert_close(cap(x), prog(x))
