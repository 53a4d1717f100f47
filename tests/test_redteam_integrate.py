"""Red-team checks of the guard fast paths (compile/protection.py, guards/instance_facts.py): a change made between
calls somewhere the per-call check skips must still be seen, the outputs equal to eager PyTorch's."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import pytest
import torch
from blocks import Cfg, Layer, Marked, OtherCfg
from torch import nn

import stampout

DEPTH, DEEP = 8, 6


class Deep(nn.Module):
    def __init__(self, layer: type[Layer], shared: bool) -> None:
        super().__init__()
        cfg = Cfg()
        self.layers = nn.ModuleList(layer(cfg if shared else Cfg()) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("layer", [Layer, Marked], ids=["plain", "regions"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared-config", "own-config"])
def test_a_config_objects_class_assigned_between_calls_is_seen(backend, layer, shared):
    """`cfg.__class__ = Other` writes through the config's own class, not through the module holding it: the class
    guard on `self.cfg` is not one only a write to a watched module can invalidate (it was: the compiled program
    kept adding the old class's `eps`)."""
    torch.manual_seed(0)
    model = Deep(layer, shared)
    fn = stampout.compile(model, backend=backend)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(fn(x), model(x))
        model.layers[DEEP].cfg.__class__ = OtherCfg
        expected = model(x)
        for _ in range(2):
            torch.testing.assert_close(fn(x), expected)
    assert fn.stats.captures == 2


def _scale_output(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out * 2


def _changed_after_three_calls(change: Callable[[nn.Module], None]) -> None:
    """A compiled Deep called three times, then `change(model)` made past every watched setter: the next call equals
    eager's."""
    torch.manual_seed(0)
    model = Deep(Marked, shared=True)
    fn = stampout.compile(model, backend="eager")
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        change(model)
        torch.testing.assert_close(fn(x), model(x))


def test_a_hook_stored_straight_into_a_modules_hook_dict_is_seen():
    _changed_after_three_calls(lambda model: model.layers[DEEP].lin._forward_hooks.__setitem__(10**6, _scale_output))


class _Base:
    scale = 1.0

    @staticmethod
    def compute(x: torch.Tensor) -> torch.Tensor:
        return x * 1.0


class _Helper(_Base):
    pass


class _Meta(type):
    factor = 1.0


class _WithMeta(metaclass=_Meta):
    pass


class ClassValueLayer(nn.Module):
    """Reads classes reached as values (a global, an attribute): nothing watches their attribute reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kind = _Helper

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Helper.compute(self.lin(x)) + self.kind.scale + _WithMeta.factor
        return x + 0.1 * torch.tanh(y)


class ClassValueDeep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClassValueLayer() for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


_SHADOWS = {
    "subclass-shadows-staticmethod": lambda: setattr(_Helper, "compute", staticmethod(lambda x: x * 3.0)),
    "subclass-shadows-attribute": lambda: setattr(_Helper, "scale", 2.0),
    "class-shadows-metaclass-attribute": lambda: setattr(_WithMeta, "factor", 3.0),
    "bases-assigned": lambda: setattr(_Helper, "__bases__", (type("Other", (_Base,), {"scale": 7.0}),)),
}


@pytest.fixture
def _classes_restored():
    yield
    _Helper.__bases__ = (_Base,)
    for cls, name in ((_Helper, "compute"), (_Helper, "scale"), (_WithMeta, "factor")):
        if name in cls.__dict__:
            delattr(cls, name)


@pytest.mark.usefixtures("_classes_restored")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("change", _SHADOWS.values(), ids=_SHADOWS.keys())
def test_a_name_shadowed_on_a_class_reached_as_a_value_is_seen(change, backend):
    """A class reached as a value has each class of its MRO's dict guarded item by item: a name a subclass (or the
    class over a metaclass's) adds later shadows the base's, a `__bases__` assignment makes another MRO; neither
    was seen (the compiled program kept the base's value)."""
    torch.manual_seed(0)
    model = ClassValueDeep()
    fn = stampout.compile(model, backend=backend)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(fn(x), model(x))
        change()
        expected = model(x)
        for _ in range(2):
            torch.testing.assert_close(fn(x), expected)
    assert fn.stats.captures == 2


def test_a_modules_dict_replaced_past_its_setattr_is_seen():
    def replace(model: nn.Module) -> None:
        layer = model.layers[DEEP]
        object.__setattr__(layer, "__dict__", dict(layer.__dict__, cfg=OtherCfg()))

    _changed_after_three_calls(replace)


class _ReadsHelpersThing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + helpers.Thing().val  # noqa: F821 (a module global the test sets)


def _helpers_module(tmp_path, monkeypatch, name: str):
    (tmp_path / f"{name}.py").write_text("class Thing:\n    val = 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)  # (a second run of the test: its own module, val 1.0)
    return importlib.import_module(name)


def _thing_changed_is_seen(model: nn.Module, module) -> None:
    fn = stampout.compile(model, backend="eager")
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(fn(x), model(x))
        module.Thing.val = 2.0
        torch.testing.assert_close(fn(x), model(x))
    assert fn.stats.captures == 2


def test_a_class_reached_through_a_module_global_has_its_attributes_guarded(tmp_path, monkeypatch):
    """`helpers.Thing().val` (a class found as an attribute of a module global, instantiated in the program): the
    class was guarded by identity in the module's namespace only, so `helpers.Thing.val = 2.0` was not seen."""
    module = _helpers_module(tmp_path, monkeypatch, "redteam_helpers_global")
    monkeypatch.setitem(globals(), "helpers", module)
    _thing_changed_is_seen(_ReadsHelpersThing(), module)


def test_a_class_reached_through_a_module_in_a_closure_has_its_attributes_guarded(tmp_path, monkeypatch):
    """`module.Thing().val` with the module held in a closure cell: the attribute chains loaded from the cell are
    walked as a global's (code_facts' cell_chains), so the class is adopted and `module.Thing.val = 2.0` is seen."""
    module = _helpers_module(tmp_path, monkeypatch, "redteam_helpers_cell")

    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + module.Thing().val

    _thing_changed_is_seen(Reads(), module)
