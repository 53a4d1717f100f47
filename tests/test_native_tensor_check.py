"""The native pass over many tensors (torch_internals.tensor_facts): it passes exactly while each tensor keeps the
class and metadata (and, asked, the data pointer) it had, and a compiled call reading many tensors per call from
an input object sees each in-place change of one as eager does."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import stampout
from stampout.torch_internals.native_tensors import NATIVE_FROM, native, tensor_facts

pytestmark = pytest.mark.skipif(native() is None, reason="no C++ compiler for the native check: the Python checks run")


def _tensors() -> tuple:
    base = torch.zeros(4, 3, 8)
    return (*base.unbind(0), torch.ones(5), nn.Parameter(torch.ones(2, 2)))


CHANGES = {
    "set_": lambda t: t.set_(torch.zeros(3, 8)),
    "as_strided_ offset": lambda t: t.as_strided_((3, 8), (8, 1), t.storage_offset() + 1),
    "transposed": lambda t: t.as_strided_((8, 3), (1, 8)),
    "resize_": lambda t: t.resize_(2, 8),
    "requires_grad_": lambda t: t.requires_grad_(),
    "storage resized": lambda t: t.untyped_storage().resize_(t.untyped_storage().nbytes() * 2),
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("pointers", [False, True])
def test_a_change_to_one_tensor_fails_the_check(change, pointers):
    tensors = _tensors()
    check = tensor_facts(tensors, pointers=pointers)
    assert check(tensors) and check(tuple(tensors))
    CHANGES[change](tensors[1])
    moved_only = change == "storage resized"  # (its metadata as it was: only the pointer differs)
    assert check(tensors) is (moved_only and not pointers)


def test_other_tensors_classes_and_modes_fail_it():
    tensors = _tensors()
    check = tensor_facts(tensors)
    assert not check((*tensors[:-1], torch.ones(2, 2)))  # (a tensor where a parameter was)
    assert not check(tensors[:-1])
    assert not check((*tensors[:-1], torch.ones(2, 2, dtype=torch.float64)))
    with torch.inference_mode():
        assert not check(tensors)
    assert check(tensors)
    assert tensor_facts((torch.ones(2).to_sparse(),)) is None


class Cache:
    def __init__(self, n: int) -> None:
        self.keys = [torch.randn(2, 3) for _ in range(n)]


class Reader(nn.Module):
    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        for k in cache.keys:
            x = x + k.sum()
        return x


@pytest.mark.parametrize("change, captures", [("set_", 1), ("as_strided_", 2), ("requires_grad_", 2), ("alias", 2)])
def test_many_tensors_read_per_call_changed_in_place_are_seen(change, captures):
    """(`set_` to other memory of the same layout: the same program, its input read anew; other strides, grad, or
    the input's own memory: captured again)"""
    cache = Cache(2 * NATIVE_FROM)
    model = Reader()
    fn = stampout.compile(model, backend="eager")
    x = torch.randn(2, 3)
    for _ in range(3):
        torch.testing.assert_close(fn(x, cache), model(x, cache))
    t = cache.keys[5]
    if change == "set_":
        t.set_(torch.full((2, 3), 7.0))
    elif change == "as_strided_":
        t.set_(torch.arange(12.0).reshape(2, 6)[:, :3])
    elif change == "requires_grad_":
        t.requires_grad_()
    else:
        t.set_(x.untyped_storage(), 0, (2, 3), (3, 1))  # (now the input's memory)
    torch.testing.assert_close(fn(x, cache), model(x, cache))
    torch.testing.assert_close(fn(x, cache), model(x, cache))
    assert fn.stats.captures == captures


_FIRST_BUILD = r"""
import functools, time, torch, stampout
from torch import nn
from stampout.torch_internals import native_tensors


class Cache:
    def __init__(self, n):
        self.keys = [torch.randn(2, 3) for _ in range(n)]


class Reader(nn.Module):
    def forward(self, x, cache):
        for k in cache.keys:
            x = x + k.sum()
        return x


cache, model, x = Cache(32), Reader(), torch.randn(2, 3)
fn = stampout.compile(model, backend="eager")
for _ in range(3):  # (the build runs in the background meanwhile: the calls take the Python checks)
    torch.testing.assert_close(fn(x, cache), model(x, cache))
assert native_tensors.pending()
native_tensors._BUILDING[0].join()
for _ in range(3):
    torch.testing.assert_close(fn(x, cache), model(x, cache))
entry = fn._compiled._entries[-1]
assert isinstance(entry.deferred.fast, functools.partial), entry.deferred.fast  # (the native check now)
cache.keys[3].as_strided_((3, 2), (1, 3))
torch.testing.assert_close(fn(x, cache), model(x, cache))
assert fn.stats.captures == 2
"""


def test_the_first_build_runs_beside_the_calls(tmp_path):
    """In a process whose cache has no build yet, no call waits for it: the Python checks run until it is there."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", _FIRST_BUILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_instance_dicts_check_sees_writes_and_replaced_dicts():
    from stampout.torch_internals import instance_dicts_sentinel

    mods = [nn.Linear(2, 2) for _ in range(4)]
    changes = [lambda m: setattr(m, "foo", 1), lambda m: m.__dict__.__setitem__("bar", 2),
               lambda m: object.__setattr__(m, "__dict__", dict(m.__dict__)), lambda m: m.__dict__.pop("bar", None)]
    for change in changes:
        unwritten = instance_dicts_sentinel(mods)
        assert isinstance(unwritten, functools.partial) and unwritten.func.__name__ == "check_dicts"
        assert unwritten()
        change(mods[2])
        assert not unwritten()
