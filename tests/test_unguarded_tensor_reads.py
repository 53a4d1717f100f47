"""Python decisions on tensor facts no guard sees (an address, leaf-ness, view-ness, shared memory, the storage's
size): a compiled program that reads one runs eagerly, a region that reads one is traced per call, and `capture`
refuses where a traced tensor cannot answer (it has no memory). Each case is checked against eager on a second
call whose input differs only in that fact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout


def _aliasing_shortcut(a, b):
    if a.data_ptr() == b.data_ptr():
        return a * 2
    return a + b


def _storage_ptr_shortcut(a, b):
    return a * 2 if a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() else a + b


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fn", [_aliasing_shortcut, _storage_ptr_shortcut])
def test_an_address_comparison_follows_eager(backend, fn):
    stampout.reset()
    compiled = stampout.compile(fn, backend=backend)
    x, y = torch.ones(2), torch.full((2,), 3.0)
    for a, b in ((x, y), (x, x), (x, y)):
        torch.testing.assert_close(compiled(a, b), fn(a, b))


def test_capture_refuses_an_address_read_naming_the_line():
    stampout.reset()
    with pytest.raises(stampout.CaptureError, match=r"data_ptr\(\)[\s\S]*test_unguarded_tensor_reads\.py:\d+"):
        stampout.capture(_aliasing_shortcut, torch.ones(2), torch.ones(2))


a_leaf = torch.ones(2, requires_grad=True)
a_base = torch.arange(6.0)
a_tensor = torch.ones(3)
# (name, program, first input, second input that differs from the first only in the fact the program reads)
CASES = [
    ("is_leaf", lambda x: x * 2 if x.is_leaf else x * 3, lambda: a_leaf, lambda: a_leaf * 1),
    ("grad_fn", lambda x: x * 2 if x.grad_fn is None else x * 3, lambda: a_leaf, lambda: a_leaf * 1),
    ("_base", lambda x: x * 10 if x._base is not None else x, lambda: a_base[:3].clone(), lambda: a_base[:3]),
    ("_is_view", lambda x: x * 10 if x._is_view() else x, lambda: a_base[:3].clone(), lambda: a_base[:3]),
    ("is_shared", lambda x: x * 10 if x.is_shared() else x, lambda: a_tensor.clone(),
     lambda: a_tensor.clone().share_memory_()),
    ("storage nbytes", lambda x: x * x.untyped_storage().nbytes(), lambda: torch.ones(8)[:2],
     lambda: torch.ones(16)[:2]),
]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("name, fn, first, second", CASES, ids=[c[0] for c in CASES])
def test_a_decision_on_an_unguarded_fact_is_not_baked(backend, name, fn, first, second):
    stampout.reset()
    compiled = stampout.compile(fn, backend=backend)
    for make in (first, second, first):
        x = make()
        torch.testing.assert_close(compiled(x), fn(x))


class LeafAware(nn.Module):
    def forward(self, x):
        return x.sin() if x.is_leaf else x.cos()


def _two_region_calls():
    region = stampout.region(LeafAware())
    return lambda x: region(x) + region(x * 1)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_region_reading_is_leaf_follows_eager_when_compiled(backend):
    stampout.reset()
    program = _two_region_calls()
    compiled = stampout.compile(program, backend=backend)
    x = torch.ones(3, requires_grad=True)
    for _ in range(2):
        torch.testing.assert_close(compiled(x), program(x))


def test_capture_refuses_is_leaf_read_in_a_region():
    stampout.reset()
    with pytest.raises(stampout.CaptureError, match=r"is_leaf[\s\S]*test_unguarded_tensor_reads\.py:\d+"):
        stampout.capture(_two_region_calls(), torch.ones(3, requires_grad=True))


def test_a_tensor_over_a_numpy_arrays_memory_is_refused_by_capture_and_run_eagerly_by_compile():
    # (capture raised "a fake tensor ... reached the graph without being recorded", "report this as a stampout bug")
    import numpy as np

    class OverArray(nn.Module):
        def __init__(self):
            super().__init__()
            self.arr = np.ones(4, dtype=np.float32)
            self.buf = bytearray(np.ones(4, dtype=np.float32).tobytes())

        def forward(self, x):
            return x * torch.from_numpy(self.arr) + torch.frombuffer(self.buf, dtype=torch.float32)

    model, x = OverArray(), torch.ones(4)
    with pytest.raises(stampout.CaptureError, match="over a Python object's memory"):
        stampout.capture(model, x)
    fn = stampout.compile(model, backend="aot_eager")
    fn(x)
    model.arr *= 3
    model.buf[0:4] = np.float32(5.0).tobytes()
    torch.testing.assert_close(fn(x), model(x))
