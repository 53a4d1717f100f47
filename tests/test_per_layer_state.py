"""One layer that differs from the others must not be stamped out from their trace: a per-instance forward, a class
default overridden on one instance, a `functools.partial` activation, a decision on a constant tensor's value,
tied weights, a slots dataclass, an exact type check, reads through an instance `__dict__`."""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from blocks import Block, D, Mlp, sample, stack_of
from helpers import check_call, check_capture
from torch import nn

import stampout


@pytest.mark.parametrize("kind", ["lambda", "bound"])
def test_case01_per_instance_forward_on_submodule_is_guarded(kind: str) -> None:
    """`layers[3].mlp.forward = ...` (a lambda or a bound method with other code) must not be stamped out
    from layer 0's trace."""
    model = stack_of(Block, 5)
    mlp = model[3].mlp
    if kind == "lambda":
        mlp.forward = lambda x: mlp.fc(x) * 3.0
    else:
        def doubled(self: Mlp, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.fc(x)) - 1.0

        mlp.forward = types.MethodType(doubled, mlp)
    cap = check_capture(model, sample())
    assert cap.stats.traces >= 2


def test_case02_class_default_overridden_on_one_instance() -> None:
    """A class-level `use_gate = False` overridden on one instance changes that layer's branch."""

    class Gated(nn.Module):
        use_gate = False

        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(D, D)

        @stampout.region
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            if self.use_gate:
                h = h * torch.sigmoid(h)
            return h

    model = stack_of(Gated, 4)
    model[2].use_gate = True
    cap = check_capture(model, sample())
    assert cap.stats.traces >= 2
    # the reverse: the first layer overrides, the others read the class default
    model = stack_of(Gated, 4)
    model[0].use_gate = True
    cap = check_capture(model, sample())
    assert cap.stats.traces >= 2


def test_case03_functools_partial_activation_per_layer() -> None:
    """`self.act = functools.partial(F.leaky_relu, negative_slope=a)` differing per layer."""

    class Act(nn.Module):
        def __init__(self, slope: float) -> None:
            super().__init__()
            self.fc = nn.Linear(D, D)
            self.act = functools.partial(F.leaky_relu, negative_slope=slope)

        @stampout.region
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.fc(x))

    torch.manual_seed(0)
    model = nn.Sequential(Act(0.01), Act(0.5), Act(0.01), Act(2.0))
    cap = check_capture(model, -sample().abs())
    assert cap.stats.traces == 3


def test_case04_decision_on_constant_tensor_value() -> None:
    """`if bool((mask == 0).all()): return x` on masks built from torch.zeros / torch.ones."""

    @stampout.region
    def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if bool((mask == 0).all()):
            return x
        return x * mask + 1.0

    def prog(x: torch.Tensor) -> torch.Tensor:
        h = masked(x, torch.zeros(2, D))
        h = masked(h, torch.ones(2, D))
        return masked(h, torch.zeros(2, D))

    cap = check_capture(prog, sample(grad=True))
    assert cap.stats.traces == 2

    def reverse(x: torch.Tensor) -> torch.Tensor:
        return masked(masked(x, torch.ones(2, D)), torch.zeros(2, D))

    check_capture(reverse, sample(grad=True))


class Tied(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.a = nn.Linear(D, D, bias=False)
        self.b = nn.Linear(D, D, bias=False)
        if tie:
            self.b.weight = self.a.weight

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("order", [(True, False), (False, True), (True, False, True, False)])
def test_case05_tied_and_untied_weights(order: tuple[bool, ...]) -> None:
    """A layer whose two linears share one weight and a layer whose do not (equal shapes)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Tied(t) for t in order])
    check_capture(model, sample(grad=True))


def test_case05_tying_weights_between_compiled_calls() -> None:
    """Tying (then untying) a layer's weights between compiled calls."""
    torch.manual_seed(0)
    model = nn.Sequential(Tied(False), Tied(False))
    fn = stampout.compile(model, backend="eager")
    check_call(model, fn, sample(grad=True), what="untied")
    model[1].b.weight = model[1].a.weight
    check_call(model, fn, sample(grad=True), what="layer 1 tied")
    model[1].b.weight = nn.Parameter(torch.randn(D, D))
    check_call(model, fn, sample(grad=True), what="layer 1 untied again")


@dataclass(slots=True)
class SlotCfg:
    scale: float = 1.0
    shift: bool = False


SLOT_CFG = SlotCfg()


@stampout.region
def _scaled_by_global_slots(x: torch.Tensor) -> torch.Tensor:
    h = x * SLOT_CFG.scale
    if SLOT_CFG.shift:
        h = h + 1.0
    return h


def test_case06_slots_dataclass_mutated_between_region_calls() -> None:
    """A `@dataclass(slots=True)` config (global, then closure) changed between two calls in one program."""

    def prog(x: torch.Tensor) -> torch.Tensor:
        SLOT_CFG.scale, SLOT_CFG.shift = 1.0, False
        h = _scaled_by_global_slots(x)
        SLOT_CFG.scale = 3.0
        h = _scaled_by_global_slots(h)
        SLOT_CFG.shift = True
        h = _scaled_by_global_slots(h)
        SLOT_CFG.scale, SLOT_CFG.shift = 1.0, False
        return h

    cap = check_capture(prog, sample(grad=True))
    assert cap.stats.traces == 3

    cfg = SlotCfg()

    @stampout.region
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * cfg.scale + (1.0 if cfg.shift else 0.0)

    def closure_prog(x: torch.Tensor) -> torch.Tensor:
        cfg.scale, cfg.shift = 1.0, False
        h = scaled(x)
        cfg.scale = 5.0
        h = scaled(h)
        cfg.shift = True
        return scaled(h)

    cap = check_capture(closure_prog, sample(grad=True))
    assert cap.stats.traces == 3


class TypeChecked(nn.Module):
    """Branches on `type(self.act) is nn.Tanh` (exact class, as some model code does)."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.act = act

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if type(self.act) is nn.Tanh:
            return x + self.act(h)
        return x + h * 0.5


def test_family_exact_type_checks_see_the_real_class() -> None:
    """`type(m) is Cls` inside a captured program must see the user's class, not a tracking shim."""
    torch.manual_seed(0)
    check_capture(nn.Sequential(TypeChecked(nn.Tanh()), TypeChecked(nn.Sigmoid())), sample(grad=True))
    torch.manual_seed(0)
    model = nn.Sequential(TypeChecked(nn.Tanh()), TypeChecked(nn.Tanh()))
    fn = stampout.compile(model, backend="eager")
    check_call(model, fn, sample(grad=True))


class DictReader(nn.Module):
    def __init__(self, how: str, scale: float) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.how = how
        self.scale = scale

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.__dict__["scale"] if self.how == "dict" else vars(self)["scale"]
        return x + torch.tanh(self.fc(x)) * s


@pytest.mark.parametrize("how", ["dict", "vars"])
def test_family_reads_through_instance_dict_are_guarded(how: str) -> None:
    """`self.__dict__["scale"]` / `vars(self)["scale"]` differing per layer."""
    torch.manual_seed(0)
    model = nn.Sequential(DictReader(how, 0.5), DictReader(how, -2.0))
    check_capture(model, sample(grad=True))
