"""A `try` of the program's around torch calls whose kernel error depends on values (cholesky of a matrix that is
not positive-definite, an index out of range): compile gives eager's result (the `except` branch runs, the side
effects before it happen once), capture refuses with the line; a `try` that cannot catch a kernel error (`except
KeyError`, `finally`), one around torch calls that check no values, or one around the compiled call itself, leaves
the program captured whole."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import same
from torch import nn

import stampout

PD, NOT_PD = torch.eye(3) * 2, -torch.eye(3)


class Cholesky(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.log = []

    def forward(self, a):
        h = self.lin(a)
        self.log.append(len(self.log))  # (a side effect before the raise: once per call, as in eager)
        try:
            factor = torch.linalg.cholesky(a)
        except torch.linalg.LinAlgError:
            factor = torch.full_like(a, -1.0)
        return h + factor


class Lookup(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(5, 3)

    def forward(self, idx):
        try:
            return self.emb(idx) * 2
        except (IndexError, RuntimeError):
            return torch.zeros(*idx.shape, 3)


def _differential(make, calls, backend):
    model, ref = make(), make()
    fn = stampout.compile(model, backend=backend)
    for x in calls:
        same(fn, ref, x)
    return fn, model, ref


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_cholesky_error_runs_the_except(backend):
    fn, model, ref = _differential(Cholesky, [PD, NOT_PD, PD, NOT_PD], backend)
    assert model.log == ref.log == [0, 1, 2, 3]
    assert [b.module_type for b in fn.breaks] == ["Cholesky"]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_index_error_runs_the_except(backend):
    calls = [torch.tensor([1, 2]), torch.tensor([1, 7]), torch.tensor([0, 4]), torch.tensor([9, 0])]
    _differential(Lookup, calls, backend)


def test_capture_refuses_naming_the_try():
    with pytest.raises(stampout.CaptureError, match=r"linalg_cholesky runs inside a try whose except \(at "
                                                    r".*test_caught_kernel_errors.py:\d+\)"):
        stampout.capture(Cholesky(), PD)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    @stampout.region
    def forward(self, a):
        return self.lin(a) + torch.linalg.cholesky(a)


class StampedInTry(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = Layer(), Layer()

    def forward(self, x):
        h = self.first(x.abs() + PD)
        try:
            second = self.second(x)  # (a stamped call of the first's trace: no torch call of it is traced)
        except RuntimeError:
            second = torch.full((3, 3), -100.0)
        return h + second


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_region_stamped_inside_a_try(backend):
    _differential(StampedInTry, [PD, NOT_PD, PD * 3], backend)


class NotCaught(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.table = {}

    def forward(self, a):
        try:  # (linear and add check no values: their errors are seen on fakes)
            h = self.lin(a) + self.table["shift"]
        except (KeyError, RuntimeError):
            h = self.lin(a)
        try:
            h = h + torch.linalg.cholesky(a).sum()
        except KeyError:
            pass
        try:
            out = torch.linalg.cholesky(a) + h
        finally:
            self.done = True
        return out


def test_a_try_that_cannot_catch_a_kernel_error_is_captured():
    fn, _, _ = _differential(NotCaught, [PD, PD * 2], "aot_eager")
    assert not fn.breaks and fn.stats.captures == 1


def test_a_try_around_the_compiled_call_is_not_the_programs():
    fn = stampout.compile(Layer(), backend="aot_eager")
    caught = False
    for a in (PD, NOT_PD, PD):
        try:
            fn(a)
        except torch.linalg.LinAlgError:
            caught = True
    assert caught and not fn.breaks and fn.stats.captures == 1


class Suppressed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)

    def forward(self, a):
        factor = torch.zeros(3, 3)
        with torch.no_grad():  # (a manager that suppresses nothing: captured)
            shift = self.lin.bias.sum()
        with contextlib.suppress(torch.linalg.LinAlgError):
            factor = torch.linalg.cholesky(a)
        return self.lin(a) + factor + shift


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_contextlib_suppress_around_a_kernel_error(backend):
    fn, _, _ = _differential(Suppressed, [PD, NOT_PD, PD * 3, NOT_PD], backend)
    assert [b.module_type for b in fn.breaks] == ["Suppressed"]


class StaticCacheWrite(nn.Module):
    """transformers' StaticLayer.update: `except NotImplementedError` (a device without the kernel) cannot catch an
    index check's RuntimeError or IndexError: captured whole."""

    def __init__(self):
        super().__init__()
        self.register_buffer("keys", torch.zeros(2, 6))

    def forward(self, position, states):
        try:
            self.keys.index_copy_(1, position, states)
        except NotImplementedError:
            self.keys[:, position] = states
        return self.keys * 2


def test_except_not_implemented_around_index_copy_is_captured():
    model, ref = StaticCacheWrite(), StaticCacheWrite()
    fn = stampout.compile(model, backend="aot_eager")
    for step in range(3):
        position, states = torch.tensor([step]), torch.full((2, 1), float(step + 1))
        torch.testing.assert_close(fn(position, states), ref(position, states))
    torch.testing.assert_close(model.keys, ref.keys)
    assert not fn.breaks and fn.stats.captures == 1
