"""Fourth red-team round: ordinary programs that were silently wrong (or crashed), each now equal to eager, run
eagerly with a warning that names why, or refused with a StampoutError."""

from __future__ import annotations

import collections
import copy
import logging
import types

import pytest
import torch
from torch import nn

import stampout

D = 4


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, D, generator=torch.Generator().manual_seed(seed))


# ---- torch's generator reseeded inside the program -------------------------------------------------------
class Reseeds(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "manual_seed":
            torch.manual_seed(3)
            noise = torch.randn(x.shape)
        else:
            with torch.random.fork_rng():
                torch.manual_seed(3)
                noise = torch.randn(x.shape)
        return self.lin(x) + noise


@pytest.mark.parametrize("how", ["manual_seed", "fork_rng"])
def test_capture_refuses_a_program_that_reseeds_before_a_random_op(how):
    model = Reseeds(how)
    with pytest.raises(stampout.CaptureError, match="random number generator"):
        stampout.capture(model, _x())


def test_capture_of_dropout_without_reseeding_still_works():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Dropout(0.5))
    x = _x()
    cap = stampout.capture(model, x)
    state = torch.get_rng_state()
    got = cap(x)
    torch.set_rng_state(state)
    torch.testing.assert_close(got, model(x))


# ---- tensor state that is no metadata: .grad and ._version -----------------------------------------------
class ReadsGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.lin.weight.grad
        h = self.lin(x)
        return h if g is None else h + g.sum(0)


class ReadsVersion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (2.0 if x._version > 0 else 1.0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_gradient_read_in_forward_is_not_baked(backend, caplog):
    torch.manual_seed(0)
    model = ReadsGrad()
    fn = stampout.compile(copy.deepcopy(model), backend=backend)
    with caplog.at_level(logging.WARNING, logger="stampout"):
        x = _x()
        torch.testing.assert_close(fn(x), model(x))
        for m in (model, fn._orig_mod):
            m.lin.weight.grad = torch.ones(D, D)
        torch.testing.assert_close(fn(x), model(x))
    assert any(".grad" in r.getMessage() for r in caplog.records)


def test_a_version_read_in_forward_is_not_baked():
    torch.manual_seed(0)
    model = ReadsVersion()
    fn = stampout.compile(copy.deepcopy(model), backend="eager")
    torch.testing.assert_close(fn(_x()), model(_x()))
    x, y = _x(), _x()
    x.add_(0)
    y.add_(0)
    torch.testing.assert_close(fn(x), model(y))


def test_a_region_reading_grad_is_traced_per_call():
    class Block(ReadsGrad):
        pass

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    model[1].lin.weight.grad = torch.ones(D, D)
    with stampout.auto_regions(model):
        cap = stampout.capture(model, _x())
    assert cap.stats.reuses == 0
    torch.testing.assert_close(cap(_x()), model(_x()))


# ---- a user's module used as a value ----------------------------------------------------------------------
CONFIG = types.ModuleType("stampout_round4_config")  # a config module (made here; a user file's works the same)
CONFIG.SCALE = 1.0
HOLDERS = [CONFIG]
NAME = "SCALE"


def _config():
    return CONFIG


READS = {
    "attribute of self": lambda self: self.config.SCALE,
    "item of a list": lambda self: HOLDERS[0].SCALE,
    "getattr": lambda self: getattr(CONFIG, NAME),
    "vars": lambda self: vars(CONFIG)["SCALE"],
    "returned by a function": lambda self: _config().SCALE,
}


class ReadsConfig(nn.Module):
    def __init__(self, read) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.config = CONFIG
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.read(self)


@pytest.mark.parametrize("how", list(READS))
def test_a_config_module_read_as_a_value_is_guarded(how):
    CONFIG.SCALE = 1.0
    torch.manual_seed(0)
    model = ReadsConfig(READS[how])
    fn = stampout.compile(model, backend="eager")
    x = _x()
    torch.testing.assert_close(fn(x), model(x))
    CONFIG.SCALE = 3.0
    try:
        torch.testing.assert_close(fn(x), model(x))
        assert fn.stats.captures == 2
    finally:
        CONFIG.SCALE = 1.0


def test_library_modules_read_as_values_keep_reuse():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.act = "tanh"

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return getattr(torch, self.act)(self.lin(x))

    model = nn.Sequential(Block(), Block(), Block())
    with stampout.auto_regions(model):
        cap = stampout.capture(model, _x())
    assert cap.stats.traces == 1


# ---- the user's global module hooks -----------------------------------------------------------------------
@pytest.fixture
def halving_hook():
    seen: list[str] = []

    def hook(module, args, out):
        seen.append(type(module).__name__)
        return out * 0.5

    handle = nn.modules.module.register_module_forward_hook(hook)
    yield seen
    handle.remove()


@pytest.mark.parametrize(("backend", "regions"), [("eager", None), ("eager", "auto"), ("aot_eager", None)])
def test_a_global_forward_hook_runs_on_the_users_modules_only(backend, regions, halving_hook):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D))
    fn = stampout.compile(copy.deepcopy(model), backend=backend, regions=regions)
    for seed in range(2):
        halving_hook.clear()
        expected = model(_x(seed))
        eager_seen = list(halving_hook)
        halving_hook.clear()
        torch.testing.assert_close(fn(_x(seed)), expected)
        assert sorted(set(halving_hook)) == sorted(set(eager_seen))


def test_a_capture_runs_without_global_hooks_on_its_graph(halving_hook):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D))
    cap = stampout.capture(model, _x())
    torch.testing.assert_close(cap(_x()), model(_x()))


# ---- containers held by the module, changed in place between calls ---------------------------------------
class Memory(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.memory = [torch.zeros(1, D)]
        self.extra: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) + torch.cat(self.memory, 0).sum(0)
        for v in self.extra.values():
            h = h * v
        return h


@pytest.mark.parametrize("change", ["append", "dict store"])
def test_a_list_or_dict_the_module_holds_changed_in_place_is_seen(change):
    torch.manual_seed(0)
    model = Memory()
    fn = stampout.compile(model, backend="eager")
    x = _x()
    torch.testing.assert_close(fn(x), model(x))
    if change == "append":
        model.memory.append(torch.ones(1, D))
    else:
        model.extra["scale"] = 3.0
    torch.testing.assert_close(fn(x), model(x))
    assert fn.stats.captures == 2


def test_a_counter_the_module_fills_counts_every_call():
    class Counts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.stats = collections.Counter()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.stats["calls"] += 1
            return self.lin(x)

    model = Counts()
    fn = stampout.compile(model, backend="eager")
    for _ in range(3):
        fn(_x())
    assert model.stats["calls"] == 3


# ---- a Python attribute the caller sets on an input tensor after the first call --------------------------
class ScaledByAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * getattr(x, "weight_scale", 1.0)


def test_an_input_attribute_absent_at_capture_is_read_when_set():
    torch.manual_seed(0)
    model = ScaledByAttribute()
    fn = stampout.compile(model, backend="eager")
    torch.testing.assert_close(fn(_x()), model(_x()))
    x = _x()
    x.weight_scale = 3.0
    torch.testing.assert_close(fn(x), model(x))
