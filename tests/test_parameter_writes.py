"""Parameters' metadata is re-checked after a write, not on every call: every way to change it is seen."""

from __future__ import annotations

import copy

import pytest
import torch
from test_divergent import Stack
from torch import nn

import stampout


def compiled_pair(n: int = 4):
    torch.manual_seed(0)
    model = Stack(n)
    return model, copy.deepcopy(model), stampout.compile(model, backend="eager")


def warm(fn, reference, x, calls: int = 3) -> None:
    for _ in range(calls):
        torch.testing.assert_close(fn(x), reference(x))
    assert fn.stats.captures == 1


def both(model, reference, change) -> None:
    with torch.no_grad():
        change(model)
        change(reference)


def _column_major(w: torch.Tensor) -> torch.Tensor:
    return w.detach().t().contiguous().t()


@pytest.mark.parametrize("change", [
    lambda m: m.layers[1].up.weight.as_strided_((16, 8), (1, 16)),
    lambda m: m.layers[1].up.weight.set_(_column_major(m.layers[1].up.weight)),
    lambda m: setattr(m.layers[1].up.weight, "data", _column_major(m.layers[1].up.weight)),
], ids=["as_strided_", "set_", "data"])
def test_stride_change_of_a_parameter_recaptures(change):
    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    warm(fn, reference, x)
    both(model, reference, change)
    torch.testing.assert_close(fn(x), reference(x))
    assert fn.stats.captures == 2


def test_requires_grad_setter_recaptures():
    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    warm(fn, reference, x)
    model.layers[2].down.weight.requires_grad = False
    reference.layers[2].down.weight.requires_grad = False
    out = fn(x)
    assert fn.stats.captures == 2
    out.sum().backward()
    assert model.layers[2].down.weight.grad is None and model.layers[1].down.weight.grad is not None


def test_dtype_change_through_data_recaptures():
    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    warm(fn, reference, x)
    for m in (model, reference):
        for p in m.layers[1].parameters():
            p.data = p.data.double()
    torch.testing.assert_close(fn(x), reference(x))
    assert fn.stats.captures == 2


def test_dtype_change_through_swap_tensors_recaptures():
    """nn.Module._apply swaps the parameter's contents in place when asked to (torch.__future__)."""
    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    warm(fn, reference, x)
    weight = model.layers[1].up.weight
    saved = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.layers[1].double()
        reference.layers[1].double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(saved)
    assert model.layers[1].up.weight is weight and weight.dtype == torch.float64  # the same object, swapped
    torch.testing.assert_close(fn(x), reference(x))
    assert fn.stats.captures == 2


def test_inference_mode_after_no_grad_recaptures():
    """The thread's dispatch state (inference mode, autocast) is still compared on every call."""
    model, reference, fn = compiled_pair()
    x = torch.randn(3, 8)
    with torch.no_grad():
        warm(fn, reference, x)
    with torch.inference_mode():
        torch.testing.assert_close(fn(x), reference(x))
    assert fn.stats.captures == 2


def test_per_call_tensor_check_does_not_grow_with_depth():
    """A stack of parameters only: one tensor (the dispatch-state sentinel) is checked per call, at any depth."""
    for n in (2, 40):
        model, reference, fn = compiled_pair(n)
        warm(fn, reference, torch.randn(3, 8))
        (entry,) = getattr(fn, "_compiled", fn)._entries  # a CompiledModule wraps its CompiledFunction
        assert len(entry.state.tensors) == 1


def test_parameter_reads_and_writes_behave_as_before():
    p = torch.nn.Parameter(torch.ones(2, 3))
    assert type(p.data) is torch.Tensor and p.requires_grad
    p.requires_grad = False
    assert not p.requires_grad
    p.data = torch.zeros(3)
    assert p.shape == (3,) and type(p) is torch.nn.Parameter
    assert p.requires_grad_(True) is p and p.requires_grad


def test_compiled_bound_method_guards_its_module_by_writes():
    """`model.forward = stampout.compile(model.forward)` (transformers' recipe): the module behind the bound method
    is watched like a compiled module, so its attributes and parameters are not re-read on every call."""
    torch.manual_seed(0)
    model = Stack(4)
    reference = copy.deepcopy(model)
    fn = stampout.compile(model.forward, backend="eager")
    warm(fn, reference, torch.randn(3, 8))
    (entry,) = fn._entries
    assert len(entry.state.tensors) == 1 and not entry.per_call_positions
    model.layers[2].scale = reference.layers[2].scale = 3.0
    x = torch.randn(3, 8)
    torch.testing.assert_close(fn(x), reference(x))
    assert fn.stats.captures == 2
    with torch.no_grad():
        model.layers[1].up.weight.t_().t_()  # no net change: a write, then the same metadata: no recapture
    torch.testing.assert_close(fn(x), reference(x))
    assert fn.stats.captures == 2


def test_a_parameter_registry_replaced_through_the_instance_dict_is_seen():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    compiled = stampout.compile(model, backend="eager")
    x = torch.ones(4)
    compiled(x)
    compiled(x)
    lin = model[2]
    lin.__dict__["_parameters"] = {"weight": nn.Parameter(lin.weight.detach() * 3), "bias": lin.bias}
    torch.testing.assert_close(compiled(x), model(x))  # got the result with the old weight
