"""A forward that changes its module: a tensor stored on it, `param.data = ...`, a buffer registered, a submodule made
or swapped during the call, spectral norm's power-iteration buffers. Each is kept and real after the call, or
refused (capture) / run eagerly (compile) with a reason, never silently dropped."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from blocks import D, RegionStack, sample, stack_of
from helpers import TOL, check_capture, tree_assert_close
from torch import nn

import stampout


class Cached(nn.Module):
    """The rotary-embedding pattern: a tensor cache built lazily inside forward and stored on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.cache: torch.Tensor | None = None

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None or self.cache.shape[0] < x.shape[0]:
            self.cache = torch.arange(x.shape[0] * D, dtype=x.dtype).view(x.shape[0], D) / 10
        return self.fc(x) + self.cache[: x.shape[0]]


def test_family_tensor_stored_on_module_during_capture() -> None:
    """A tensor made and stored on `self` inside the captured program is left there as a real tensor (as eager
    leaves it), and the model still runs eagerly afterwards."""
    model = stack_of(Cached, 2)
    ref = copy.deepcopy(model)
    cap = stampout.capture(model, sample())
    tree_assert_close(cap(sample()), ref(sample()), **TOL)
    for i, layer in enumerate(model):
        assert type(layer.cache) is torch.Tensor, f"layers[{i}].cache is a {type(layer.cache).__name__}"
    tree_assert_close(model(sample()), ref(sample()), "eager after capture", **TOL)


class DataSetter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.ones(D))
        self.replacement = torch.full((D,), 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale.data = self.replacement  # e.g. weight loading / pruning code in forward
        return self.fc(x) * self.scale


def test_family_param_data_assignment_in_program() -> None:
    """`param.data = tensor` inside a captured program."""
    torch.manual_seed(0)
    check_capture(DataSetter(), sample())


class LazyBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "running"):
            self.register_buffer("running", torch.zeros(4))
        self.running.add_(x.mean(0))
        return self.lin(x) + self.running


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_buffer_registered_in_forward_is_real_and_kept(backend):
    torch.manual_seed(0)
    model = LazyBuffer()
    compiled_model = copy.deepcopy(model)
    fn = stampout.compile(compiled_model, backend=backend)
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(fn(x), model(x))
        assert type(compiled_model.running) is torch.Tensor
        torch.testing.assert_close(compiled_model.running, model.running)
    assert fn.stats.captures == 2  # (the first call registered it; the second reads it as a buffer)
    assert list(compiled_model.state_dict()) == list(model.state_dict())


class SwapsChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU()
        self.lin = nn.Linear(4, 4)
        self.n = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        if self.n == 2:
            self.act = nn.Tanh()  # (made during the call: a compiled call cannot make it again)
        return self.act(self.lin(x))


def test_storing_a_module_made_during_the_call_runs_eagerly_not_dropped(caplog):
    torch.manual_seed(0)
    model = SwapsChild()
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager")
    with caplog.at_level(logging.WARNING, logger="stampout.guards"):
        for _ in range(4):
            x = torch.randn(2, 4)
            torch.testing.assert_close(fn(x), reference(x))
            assert type(model.act) is type(reference.act) and model.n == reference.n
    assert "registers SwapsChild.act, a module it makes during the call" in caplog.text  # (the second call: it
    # runs eagerly, as eager)


class LazyHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleDict()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = str(x.shape[-1])
        if key not in self.heads:
            self.heads[key] = nn.Linear(x.shape[-1], 2)
        return self.heads[key](x)


def test_a_submodule_made_during_the_call_is_refused_by_capture_and_run_eagerly_by_compile(caplog):
    model = LazyHeads()
    with pytest.raises(stampout.CaptureError, match="ModuleDict.3, a module it makes during the call"):
        stampout.capture(model, torch.randn(2, 3))
    assert len(model.heads) == 0
    fn = stampout.compile(model, backend="eager")
    with caplog.at_level(logging.WARNING, logger="stampout"):
        for d in (3, 4, 3):
            x = torch.randn(2, d)
            torch.testing.assert_close(fn(x), model(x))
    assert sorted(model.heads) == ["3", "4"]
    assert any("a module it makes during the call" in r.getMessage() for r in caplog.records)
    assert all(type(p) is nn.Parameter and not isinstance(p, torch._subclasses.FakeTensor)
               for p in model.parameters())


def test_capture_of_spectral_norm_leaves_its_power_iteration_buffers_alone():
    # (spectral_norm's pre-hook stores `module.weight` (made real, as eager) and updates u, v in place: a
    # capture does not touch real tensors, as with BatchNorm's statistics; the Capture's first call does)
    torch.manual_seed(0)
    model = nn.Sequential(torch.nn.utils.spectral_norm(nn.Linear(4, 4)), nn.Tanh())
    ref = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 4)
    cap = stampout.capture(model, x)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])
    torch.testing.assert_close(cap(x), ref(x))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ref.state_dict()[k])


class CountsSteps(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "augmented":
            self.steps += 1  # (in place, then stored back: `self.steps = self.steps.__iadd__(1)`)
        else:
            self.steps.add_(1)
        return x * self.steps


@pytest.mark.parametrize("how", ["augmented", "add_"])
def test_a_buffer_counted_up_in_forward_is_left_to_the_captures_calls(how):
    # (`self.steps += 1` was made real by running the graph at capture and kept, so capture then a call counted
    # two steps where one eager call counts one; `add_` was left to the Capture's calls, as BatchNorm's statistics)
    model, x = CountsSteps(how), torch.ones(2)
    ref = copy.deepcopy(model)
    cap = stampout.capture(model, x)
    assert model.steps.item() == 0 and model.steps is model._buffers["steps"]
    assert type(model.steps) is torch.Tensor
    for _ in range(2):
        torch.testing.assert_close(cap(x), ref(x))
        torch.testing.assert_close(model.steps, ref.steps)


class HalvesItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.w.data = self.w.data * 0.5  # (reads the parameter's .data: a torch error on the real tensor before)
        return x * self.w


@pytest.mark.parametrize("how", ["capture", "eager", "aot_eager"])
def test_a_parameters_data_read_and_replaced_in_forward_matches_eager(how):
    # (aot_eager functionalizes the graph's `setattr(w, 'data', ...)` away: such a program runs eagerly)
    model, x = HalvesItsWeight(), torch.ones(4)
    ref = copy.deepcopy(model)
    run = stampout.capture(model, x) if how == "capture" else stampout.compile(model, backend=how)
    for _ in range(2):
        torch.testing.assert_close(run(x), ref(x))
        torch.testing.assert_close(model.w, ref.w)


class CarriesState(nn.Module):
    """State carried from call to call and replaced out of place: an EMA buffer, a recurrent hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))
        self.h = torch.zeros(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema = 0.9 * self.ema + 0.1 * x.mean(0)
        self.h = torch.tanh(self.lin(x) + self.h).detach()
        return self.h - self.ema


def test_state_replaced_out_of_place_is_carried_by_each_capture_call():
    # (the capture stored the graph's value, so its first call updated the state a second time, and later calls
    # stored nothing: the graph kept reading the value made at capture)
    torch.manual_seed(0)
    model = CarriesState()
    ref = copy.deepcopy(model)
    xs = [torch.randn(2, 4) for _ in range(3)]
    cap = stampout.capture(model, xs[0])
    torch.testing.assert_close((model.ema, model.h), (ref.ema, ref.h))  # (the capture ran no tensor op)
    for x in xs:
        torch.testing.assert_close(cap(x), ref(x))
        torch.testing.assert_close((model.ema, model.h), (ref.ema, ref.h))
    assert "ema" in model._buffers and type(model.ema) is torch.Tensor


class SwapsLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        self.a, self.b = self.b, self.a  # (double buffering)
        return y


class SwapsInARegion(RegionStack):
    def __init__(self) -> None:
        super().__init__(SwapsLayers() for _ in range(2))


@pytest.mark.parametrize("make", [SwapsLayers, SwapsInARegion], ids=["plain", "region"])
def test_capture_refuses_a_program_that_moves_the_modules_it_reads_parameters_through(make):
    """Each call of a Capture reads its parameters by path after the capture's stores (was: `self.a.weight` named
    the old `self.b`'s weight, and the first `cap(x)` returned another layer's output, silently); compile reads
    them before it replays the stores, as eager (tests: test_python_effects_each_call's swap)."""
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    with pytest.raises(stampout.CaptureError, match=r"rebinds the path self\..*weight") as caught:
        stampout.capture(model, x)
    assert "test_modules_changed_in_forward.py" in str(caught.value)
    reference(x)  # (the refused capture left the model as one eager call leaves it)
    torch.testing.assert_close(model(x), reference(x))


def test_a_lazy_module_is_refused_by_capture_and_initialized_eagerly_by_compile():
    """(Was: capture failed inside the lazy module's initialization with torch's raw RuntimeError on an
    UninitializedParameter.) compile runs the first call eagerly (it makes the parameters), then captures."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU())
    with pytest.raises(stampout.CaptureError, match="LazyLinear is not initialized") as caught:
        stampout.capture(model, torch.randn(2, 4))
    assert "test_modules_changed_in_forward.py" in str(caught.value)
    torch.manual_seed(0)
    model, reference = nn.Sequential(nn.LazyLinear(4), nn.ReLU()), nn.Sequential(nn.LazyLinear(4), nn.ReLU())
    fn = stampout.compile(model, backend="aot_eager")
    for i in range(3):
        x = torch.randn(2, 4)
        torch.manual_seed(i)
        got = fn(x)
        torch.manual_seed(i)
        torch.testing.assert_close(got, reference(x))
    assert fn.stats.captures == 1  # (the first call ran eagerly and initialized it)


class WalksChildren(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for name, child in self.named_children():
            if name != "base":
                y = y + child(x)
        return y + sum(p.sum() for p in self.parameters())


@pytest.mark.parametrize("change", ["add_module", "register_parameter"])
def test_a_module_walking_its_registries_sees_what_is_added_between_calls(change):
    """`self.named_children()` / `self.parameters()` in forward: the names each registry walked holds are guarded
    (was: a child or parameter added between calls was not walked by the compiled call, silently)."""
    torch.manual_seed(0)
    model = WalksChildren()
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager")
    for i in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(fn(x), reference(x))
        torch.manual_seed(i)
        if change == "add_module":
            extra = nn.Linear(4, 4)
            model.add_module(f"extra{i}", extra)
            reference.add_module(f"extra{i}", copy.deepcopy(extra))
        else:
            weight = nn.Parameter(torch.randn(4))
            model.register_parameter(f"p{i}", weight)
            reference.register_parameter(f"p{i}", copy.deepcopy(weight))


@pytest.mark.parametrize("change", ["none", "add to empty", "add", "remove", "replace", "reorder", "same key again"])
def test_registries_changed_finds_each_change_to_a_registry(change) -> None:
    """Registries.changed compares each registry with its copy from before the run: the same keys in order and the
    same values by position (an empty registry by its length alone), whatever the change."""
    from stampout.capture.effects import Registries

    lin, holder = nn.Linear(2, 2), nn.Sequential(nn.ReLU())
    registries = Registries([lin, holder])
    w, b, p = lin._parameters["weight"], lin._parameters["bias"], nn.Parameter(torch.ones(1))
    if change == "add to empty":
        lin._buffers["steps"] = torch.zeros(1)
    elif change == "add":
        holder._modules["1"] = nn.ReLU()
    elif change == "remove":
        del lin._parameters["bias"]
    elif change == "replace":
        lin._parameters["weight"] = p
    elif change == "reorder":  # (same keys and values, another order: parameters() changes)
        lin._parameters.clear()
        lin._parameters.update({"bias": b, "weight": w})
    elif change == "same key again":  # (a key rebuilt equal, the same value: no change)
        lin._parameters.clear()
        lin._parameters.update({"".join(["wei", "ght"]): w, "bias": b})
    found = [(m, name) for m, name, *_ in registries.changed()]
    expected = {"none": [], "same key again": [], "add to empty": [(lin, "_buffers")], "add": [(holder, "_modules")]}
    assert found == expected.get(change, [(lin, "_parameters")])
