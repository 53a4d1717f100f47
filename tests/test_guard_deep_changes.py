"""The per-call check of a deep model stays flat in depth by vouching for what the capture read through C++ facts
(guards/instance_facts.py: identities, classes, dict versions; a function's code, defaults and closure cells read by
their C getters) and by re-checking module state only after a watched write. Each fast path must still see the
change it skips: here an 80-layer model, compiled with stamped regions, is changed at layer 70 (or in what every
layer reads) after the memo answered, and its outputs are compared with eager's, with the exact number of
captures."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import stampout

DEPTH, DEEP, DIM = 80, 70, 4
SHIFT = 0.0  # (a global every layer reads)


def _scaled(factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * factor  # (a closure cell of the helper every layer calls)

    return scale


HELPER = _scaled(1.0)


def _act(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


def _act_other(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x)


class Layer(nn.Module):
    gain = 1.0  # (a class attribute every layer reads)

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.bias = 0.0  # (a plain attribute of each layer)
        self.helper = HELPER  # (one function every layer holds)

    def forward(self, x: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
        y = self.helper(_act(self.lin(x))) * self.gain + self.bias + SHIFT + offset
        return x + 0.1 * y


Layer.plain_forward = Layer.forward


class Marked(Layer):
    forward = stampout.region(Layer.plain_forward)


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Marked() for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _bias_set(model):
    model.layers[DEEP].bias = 1.0


def _bias_behind_setattr(model):
    model.layers[DEEP].__dict__["bias"] = 1.0


def _parameter_replaced(model):
    model.layers[DEEP].lin.weight = nn.Parameter(torch.ones(DIM, DIM))


def _parameter_set_in_place(model):
    with torch.no_grad():
        model.layers[DEEP].lin.weight.set_(torch.ones(DIM, DIM + 1)[:, :DIM])  # (other strides)


def _hook_added(model):
    model.layers[DEEP].register_forward_hook(lambda module, args, out: out * 2)


def _pre_hook_added(model):
    model.layers[DEEP].lin.register_forward_pre_hook(lambda module, args: (args[0] + 1,))


def _global_rebound(model):
    globals()["SHIFT"] = 1.0


def _class_attribute_changed(model):
    Layer.gain = 2.0


def _class_attribute_shadowed(model):
    Marked.gain = 3.0  # (found first on the subclass's MRO now)


def _instance_shadows_class_attribute(model):
    model.layers[DEEP].gain = 4.0


def _helper_replaced(model):
    model.layers[DEEP].helper = _scaled(5.0)


def _closure_cell_rebound(model):
    model.layers[DEEP].helper.__closure__[0].cell_contents = 6.0  # (the helper all layers share)


def _code_replaced(model):
    _act.__code__ = _act_other.__code__


def _layer_replaced(model):
    model.layers[DEEP] = Marked()


def _module_class_assigned(model):
    model.layers[DEEP].__class__ = type("Other", (Marked,), {"gain": 7.0})


def _train_mode(model):
    model.layers[DEEP].train(False)


def _forward_defaults_replaced(model):
    Layer.plain_forward.__defaults__ = (1.0,)


CHANGES = {"attribute-set": _bias_set, "attribute-behind-setattr": _bias_behind_setattr,
           "parameter-replaced": _parameter_replaced, "parameter-set-in-place": _parameter_set_in_place,
           "hook-added": _hook_added, "pre-hook-added": _pre_hook_added, "global-rebound": _global_rebound,
           "class-attribute-changed": _class_attribute_changed, "class-attribute-shadowed": _class_attribute_shadowed,
           "instance-shadows-class-attribute": _instance_shadows_class_attribute, "helper-replaced": _helper_replaced,
           "closure-cell-rebound": _closure_cell_rebound, "code-replaced": _code_replaced,
           "layer-replaced": _layer_replaced, "module-class-assigned": _module_class_assigned,
           "defaults-replaced": _forward_defaults_replaced}

# A parameter or a whole layer replaced by one alike: the graph takes parameters as inputs, read afresh after the
# write (their metadata equal): no recapture.
READ_AFRESH = {_parameter_replaced, _layer_replaced}


@pytest.fixture(autouse=True)
def _restored():
    code, defaults = _act.__code__, Layer.plain_forward.__defaults__
    HELPER.__closure__[0].cell_contents = 1.0
    yield
    globals()["SHIFT"] = 0.0
    Layer.gain = 1.0
    if "gain" in Marked.__dict__:
        del Marked.gain
    _act.__code__ = code
    Layer.plain_forward.__defaults__ = defaults


def _entry(fn):
    entries = [e for e in fn._compiled._entries if e.capture is not None]
    return entries[-1]


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    return torch.randn(2, DIM, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_a_change_at_layer_70_of_80_after_the_memo_answered_is_seen(change, x):
    torch.manual_seed(0)
    model = Deep().eval()
    fn = stampout.compile(model, backend="eager")
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(fn(x), model(x))
        assert _entry(fn).held.hits >= 1  # (the memo answered: the change below happens behind it)
        change(model)
        expected = model(x)
        for _ in range(2):
            torch.testing.assert_close(fn(x), expected)
    assert fn.stats.captures == (1 if change in READ_AFRESH else 2)


def test_the_memo_leaves_no_function_or_class_read_to_python(x):
    """What the deep model's per-call check reads of functions (code, defaults, closure cells: the called function's
    own and those of functions in class dicts) and of class dicts is vouched for by the C++ facts: the part the memo
    leaves to Python reads none of it, so it does not grow with the functions a program calls."""
    torch.manual_seed(0)
    model = Deep().eval()
    fn = stampout.compile(model, backend="eager")
    with torch.no_grad():
        for _ in range(3):
            fn(x)
    memo = _entry(fn).held._memo
    assert memo is not None
    rest = memo.rest.source_code
    for read in ("__code__", "__defaults__", "__closure__", "cell_contents", "_cell(", "__stampout_region__"):
        assert read not in rest, read


def _closure_reader(factor: float) -> Callable:
    offset = [0.5]

    def step(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return x * factor * scale + offset[0]

    def rebind(value: float) -> None:
        nonlocal factor
        factor = value

    return step, rebind


@pytest.mark.parametrize("how", ["cell", "defaults", "code"])
def test_the_called_functions_own_closure_defaults_and_code_are_seen(how):
    step, rebind = _closure_reader(3.0)
    fn = stampout.compile(step, backend="eager")
    x = torch.randn(3)
    for _ in range(3):
        torch.testing.assert_close(fn(x), step(x))
    (entry,) = fn._entries
    assert entry.held.hits >= 1
    rest = entry.held._memo.rest.source_code
    assert "_cell(" not in rest and "__defaults__" not in rest
    if how == "cell":
        rebind(4.0)
    elif how == "defaults":
        step.__defaults__ = (5.0,)
    else:
        step.__code__ = _minus_code(step)
    for _ in range(2):
        torch.testing.assert_close(fn(x), step(x))
    assert fn.stats.captures == 2


def _minus_code(like: Callable) -> Callable:
    """A code object with `like`'s free variables (factor, offset) that computes something else."""
    factor = offset = None

    def minus(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return x * factor * scale - offset[0]

    assert minus.__code__.co_freevars == like.__code__.co_freevars
    return minus.__code__
