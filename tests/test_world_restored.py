"""After a capture — success or error — every mode is exited and every patch undone (SPEC §3).

Each failing capture below is checked for: empty TorchFunctionMode and TorchDispatchMode stacks, no fake
mode, grad mode back on (even when the error was raised with grad disabled), autocast off with its dtype
restored, every module's class back to its original (regions swap module classes while tracing), and
torch's ``invoke_subgraph_placeholder`` back in place.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn
from torch._guards import detect_fake_mode
from torch.utils._python_dispatch import _get_current_dispatch_mode, _get_current_dispatch_mode_stack

import stampout

INVOKE_SUBGRAPH_MODULE = sys.modules["torch._higher_order_ops.invoke_subgraph"]


class Layer(nn.Module):
    """A region layer; ``fail`` makes its forward raise (ValueError) or hit data-dependent Python."""

    seen_types: list = []
    seen_placeholders: list = []

    def __init__(self, fail: str | None = None):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.scale = 2.0
        self.fail = fail

    @stampout.region
    def forward(self, x):
        Layer.seen_types.append(type(self))
        Layer.seen_placeholders.append(INVOKE_SUBGRAPH_MODULE.invoke_subgraph_placeholder)
        h = self.norm(self.lin(x)) * self.scale
        if self.fail == "value":
            raise ValueError("layer failed")
        if self.fail == "data":
            if h.sum() > 0:
                h = h + 1
        return h


class Stack(nn.Module):
    def __init__(self, fails=(None, None, None), grad_off_at_error=False, autocast_at_error=False):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Layer(f) for f in fails)
        self.head = nn.Linear(8, 2)
        self.grad_off_at_error = grad_off_at_error
        self.autocast_at_error = autocast_at_error

    def forward(self, x):
        if self.autocast_at_error:
            with torch.autocast("cpu", dtype=torch.float16):
                return self._body(x)
        if self.grad_off_at_error:
            with torch.no_grad():
                return self._body(x)
        return self._body(x)

    def _body(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _classes(model: nn.Module) -> dict[str, type]:
    return {name: type(m) for name, m in model.named_modules()}


def _assert_world_clean(model: nn.Module, classes: dict[str, type], placeholder, autocast_dtype) -> None:
    assert list(torch.overrides._get_current_function_mode_stack()) == []
    assert torch._C._len_torch_function_stack() == 0
    assert not torch._C._is_torch_function_mode_enabled()
    assert _get_current_dispatch_mode() is None
    assert list(_get_current_dispatch_mode_stack()) == []
    assert torch._C._len_torch_dispatch_stack() == 0
    assert detect_fake_mode() is None
    assert torch.is_grad_enabled()
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_autocast_dtype("cpu") == autocast_dtype
    for name, m in model.named_modules():
        assert type(m) is classes[name], (
            f"{name or 'root'}: class is still {type(m)!r} (id {id(type(m)):#x}, bases {type(m).__bases__}), "
            f"not the original {classes[name]!r} (id {id(classes[name]):#x})"
        )
        assert m.__class__ is classes[name]
    assert INVOKE_SUBGRAPH_MODULE.invoke_subgraph_placeholder is placeholder
    # real tensors behave normally again (no mode intercepts them)
    t = torch.ones(2, requires_grad=True)
    y = (t * 3).sum()
    assert type(y) is torch.Tensor and y.item() == 6.0 and y.requires_grad


CASES = {
    "value_error": (dict(fails=(None, None, "value")), ValueError),
    "capture_error": (dict(fails=(None, None, "data")), stampout.CaptureError),
    "value_error_in_no_grad": (dict(fails=(None, "value", None), grad_off_at_error=True), ValueError),
    "capture_error_in_no_grad": (dict(fails=(None, None, "data"), grad_off_at_error=True), stampout.CaptureError),
    "value_error_in_autocast": (dict(fails=(None, None, "value"), autocast_at_error=True), ValueError),
    "capture_error_in_autocast": (dict(fails=("data", None, None), autocast_at_error=True), stampout.CaptureError),
}


@pytest.mark.parametrize("case", list(CASES))
def test_world_restored_after_failing_capture(case):
    kwargs, exc = CASES[case]
    model = Stack(**kwargs)
    classes = _classes(model)
    placeholder = INVOKE_SUBGRAPH_MODULE.invoke_subgraph_placeholder
    autocast_dtype = torch.get_autocast_dtype("cpu")
    Layer.seen_types.clear()
    Layer.seen_placeholders.clear()
    x = torch.randn(3, 8)

    with pytest.raises(exc) as info:
        stampout.capture(model, x)
    if exc is ValueError:
        assert type(info.value) is ValueError and str(info.value) == "layer failed"
    assert Layer.seen_types, "the region body never ran"
    _assert_world_clean(model, classes, placeholder, autocast_dtype)

    # the model still works eagerly and a fresh capture of a healthy model still works
    for layer in model.layers:
        layer.fail = None
    expected = model(x)
    cap = stampout.capture(model, x)
    torch.testing.assert_close(cap(x), expected, rtol=1e-4, atol=1e-5)
    _assert_world_clean(model, classes, placeholder, autocast_dtype)


def test_world_restored_after_successful_capture():
    model = Stack()
    classes = _classes(model)
    placeholder = INVOKE_SUBGRAPH_MODULE.invoke_subgraph_placeholder
    autocast_dtype = torch.get_autocast_dtype("cpu")
    x = torch.randn(3, 8)
    cap = stampout.capture(model, x)
    assert cap.stats.traces >= 1
    _assert_world_clean(model, classes, placeholder, autocast_dtype)
    torch.testing.assert_close(cap(x), model(x), rtol=1e-4, atol=1e-5)


def test_grad_mode_restored_when_user_disables_grad_and_raises():
    def fn(x):
        torch.set_grad_enabled(False)  # never re-enabled by the user's code
        raise ValueError("after disabling grad")

    with pytest.raises(ValueError, match="after disabling grad"):
        stampout.capture(fn, torch.randn(2))
    assert torch.is_grad_enabled()

    def fn2(x):
        torch.set_grad_enabled(False)
        return x.sum().item()

    with pytest.raises(stampout.CaptureError):
        stampout.capture(fn2, torch.randn(2))
    assert torch.is_grad_enabled()


def test_outer_grad_mode_is_kept():
    # restoring means "as it was before capture", not "always on"
    def fn(x):
        raise ValueError("boom")

    with torch.no_grad():
        with pytest.raises(ValueError):
            stampout.capture(fn, torch.randn(2))
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()


def test_torch_marked_region_placeholder_restored():
    """A ``torch.compiler.nested_compile_region`` function reaches stampout through torch's
    ``invoke_subgraph_placeholder``, which capture swaps in and must swap back."""

    @torch.compiler.nested_compile_region
    def block(x):
        return torch.relu(x) * 2

    def bad(x):
        block(x)
        raise ValueError("after marked region")

    placeholder = INVOKE_SUBGRAPH_MODULE.invoke_subgraph_placeholder
    with pytest.raises(ValueError, match="after marked region"):
        stampout.capture(bad, torch.randn(2, 2))
    assert INVOKE_SUBGRAPH_MODULE.invoke_subgraph_placeholder is placeholder

    def good(x):
        return block(x) + block(x)

    x = torch.randn(2, 2)
    cap = stampout.capture(good, x)
    assert INVOKE_SUBGRAPH_MODULE.invoke_subgraph_placeholder is placeholder
    assert cap.stats.traces == 1
    torch.testing.assert_close(cap(x), good(x))


@pytest.mark.parametrize("how", ["capture", "compile"])
def test_a_user_running_cprofile_keeps_it_and_gets_no_graph_break(how, caplog):
    # (cProfile's profiler is a C function: sys.getprofile() returns its Profiler object, which is not callable;
    # chaining it or handing it back to sys.setprofile broke every capture made while profiling)
    import cProfile
    import logging

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    x = torch.randn(2, 8)
    expected = model(x)
    profiler = cProfile.Profile()
    with caplog.at_level(logging.WARNING, logger="stampout"):
        profiler.enable()
        try:
            if how == "capture":
                got = stampout.capture(model, x)(x)
            else:
                fn = stampout.compile(model, backend="eager")
                got = fn(x)
            still_on = sys.getprofile() is profiler
        finally:
            profiler.disable()
    torch.testing.assert_close(got, expected)
    assert still_on
    assert not [r for r in caplog.records if "graph break" in r.getMessage() or "eagerly" in r.getMessage()]
    if how == "compile":
        assert fn.stats.captures == 1 and not fn.breaks
