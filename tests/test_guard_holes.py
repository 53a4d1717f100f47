"""Guard holes of issue 22, family 4 and the crashes: each differential against eager, world after the call included.

Torch-level names rebound after compile, storage overlap of distinct inputs, caller-passed containers the
program fills, Python attributes of input tensors, and ordinary code whose capture fails (autograd.grad, LSTM
at a second length, a user backend that returns the graph in training).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stampout
from stampout.trace.structure import aliases_of

BACKENDS = ["eager", "aot_eager"]


def _my_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return x * 100.0


def _uses_f_gelu(x):
    return F.gelu(x) * 2


def _uses_full_path(x):
    return torch.nn.functional.gelu(x) + 1


def _uses_torch_relu(x):
    return torch.relu(x) - 1


def _uses_math(x):
    return x * math.sqrt(x.shape[0])


act = F.gelu


def _uses_alias(x):
    return act(x) * 3


class _UsesSilu(nn.Module):
    def forward(self, x):
        return F.silu(x) + 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn, owner, name", [
    (_uses_f_gelu, F, "gelu"),
    (_uses_full_path, F, "gelu"),
    (_uses_torch_relu, torch, "relu"),
    (_uses_math, math, "sqrt"),
    (_UsesSilu(), F, "silu"),
    (_uses_alias, __import__(__name__), "act"),
], ids=["F.gelu", "torch.nn.functional.gelu", "torch.relu", "math.sqrt", "module F.silu", "module alias"])
def test_rebinding_a_function_the_program_calls_recaptures(backend, fn, owner, name, monkeypatch):
    compiled = stampout.compile(fn, backend=backend)
    x = torch.randn(4)
    torch.testing.assert_close(compiled(x), fn(x))
    torch.testing.assert_close(compiled(x), fn(x))
    assert compiled.stats.captures == 1
    replacement = (lambda v: 100.0) if owner is math else _my_gelu
    monkeypatch.setattr(owner, name, replacement)
    torch.testing.assert_close(compiled(x), fn(x))
    assert compiled.stats.captures == 2
    monkeypatch.undo()
    torch.testing.assert_close(compiled(x), fn(x))  # the first entry again
    assert compiled.stats.captures == 2


@pytest.mark.parametrize("name", ["gelu", "linear"])
def test_rebinding_a_function_torch_nn_modules_call_recaptures(name, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.GELU())
    compiled = stampout.compile(model, backend="aot_eager")
    x = torch.randn(2, 3)
    compiled(x)
    compiled(x)
    assert compiled.stats.captures == 1
    monkeypatch.setattr(F, name, lambda v, *args, **kwargs: v * 0 + 7)
    torch.testing.assert_close(compiled(x), model(x))
    assert compiled.stats.captures == 2


def _branches_on_compiling(x):
    return x + 1 if torch.compiler.is_compiling() else x + 2


def test_stampouts_own_stand_ins_are_not_guarded():
    compiled = stampout.compile(_branches_on_compiling, backend="eager")
    for _ in range(3):
        compiled(torch.zeros(1))
    assert compiled.stats.captures == 1


def test_unrelated_write_to_a_torch_namespace_keeps_the_entry(monkeypatch):
    compiled = stampout.compile(_uses_f_gelu, backend="eager")
    x = torch.randn(4)
    compiled(x)
    monkeypatch.setattr(F, "_stampout_test_unrelated", 1, raising=False)
    torch.testing.assert_close(compiled(x), _uses_f_gelu(x))
    assert compiled.stats.captures == 1


def _adds_one(x):
    return x.add(1) * 2


def test_patched_tensor_method_runs_eagerly_with_eager_result(monkeypatch, caplog):
    compiled = stampout.compile(_adds_one, backend="aot_eager")
    x = torch.randn(4)
    torch.testing.assert_close(compiled(x), _adds_one(x))
    original = torch.Tensor.add
    monkeypatch.setattr(torch.Tensor, "add", lambda self, other: original(self, other) + 100, raising=False)
    with caplog.at_level(logging.WARNING):
        torch.testing.assert_close(compiled(x), _adds_one(x))
    assert "torch.Tensor.add" in caplog.text
    assert compiled.stats.captures == 2


# ---------------------------------------------------------------------------------------- storage overlap


def _add_then_mul(a, b):
    a.add_(1)
    return a * b


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlapping_inputs_do_not_reuse_the_disjoint_capture(backend):
    compiled = stampout.compile(_add_then_mul, backend=backend)
    for overlap, captures in ((False, 1), (True, 2), (False, 2), (True, 2)):
        base, ref = torch.arange(10.0), torch.arange(10.0)
        other, other_ref = torch.arange(10.0) + 20, torch.arange(10.0) + 20
        got = compiled(base[:5], (base if overlap else other)[1:6])
        expected = _add_then_mul(ref[:5], (ref if overlap else other_ref)[1:6])
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(base, ref)
        assert compiled.stats.captures == captures


def test_aliases_tell_overlap_exactly_for_split_halves():
    h = torch.zeros(2, 8)
    assert aliases_of([h[:, :4], h[:, 4:]]) == (0, 1)  # interleaved rows, no common element
    assert aliases_of([h[:, ::2], h[:, 1::2]]) == (0, 1)
    assert aliases_of([h[:, :5], h[:, 3:]]) == (0, 1, ((0, 1),))
    assert aliases_of([h, h[1:]]) == (0, 1, ((0, 1),))
    b = torch.arange(10.0)
    assert aliases_of([b[:5], b[5:]]) == (0, 1)
    assert aliases_of([b[:5], b[4:9]]) == (0, 1, ((0, 1),))
    assert aliases_of([b, b]) == (0, 0)


# ---------------------------------------------------------------------------------- caller-passed containers


def _fills_dict(x, cache):
    cache["k"] = x * 2
    cache.setdefault("n", 0)
    cache.update(v=x + 1)
    return x + 1


def _deletes_and_adds(x, cache):
    if "old" in cache:
        del cache["old"]
    cache["new"] = x
    return x * 2


def _list_ops(x, items):
    items.append(x.sum())
    items.insert(0, x * 3)
    items.extend([1, 2])
    return x + len(items)


def _nested(x, cache):
    layer = cache.setdefault("layer0", {})
    layer["k"] = x
    layer.setdefault("history", []).append(x.mean())
    return x - 1


def _nested_existing(x, cache):
    cache["layers"][0]["k"] = x * 5
    return x


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return type(b) is list and len(a) == len(b) and all(_same(p, q) for p, q in zip(a, b))
    return a == b


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn, make", [
    (_fills_dict, dict), (_deletes_and_adds, lambda: {"old": 1, "keep": 2}), (_list_ops, lambda: [torch.zeros(1)]),
    (_nested, dict), (_nested_existing, lambda: {"layers": [{}]}),
], ids=["dict", "del", "list", "nested", "nested-existing"])
def test_caller_container_is_filled_by_every_compiled_call(backend, fn, make):
    compiled = stampout.compile(fn, backend=backend)
    for i in range(3):
        x = torch.full((3,), float(i + 1))
        mine, theirs = make(), make()
        torch.testing.assert_close(compiled(x, mine), fn(x.clone(), theirs))
        assert _same(mine, theirs), (mine, theirs)
    assert compiled.stats.captures == 1


def _grows(x, cache):
    cache["k"] = torch.cat([cache["k"], x]) if "k" in cache else x * 1
    cache["x"] = x
    return cache["k"].sum()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_kv_dict_read_by_the_next_call_matches_eager(backend):
    compiled = stampout.compile(_grows, backend=backend)
    mine, theirs = {}, {}
    for i in range(5):
        x = torch.full((2,), float(i))
        y = x.clone()
        torch.testing.assert_close(compiled(x, mine), _grows(y, theirs))
        assert torch.equal(mine["k"], theirs["k"])
        assert mine["x"] is x  # the input itself, as eager stores it
    assert compiled.stats.captures == 3  # empty, one entry, then the growing length symbolic


def _fills_kwarg(x, *, cache):
    cache["k"] = x + 1
    return x


def test_keyword_container_is_filled():
    compiled = stampout.compile(_fills_kwarg, backend="eager")
    for i in range(2):
        cache: dict = {}
        compiled(torch.full((2,), float(i)), cache=cache)
        assert torch.equal(cache["k"], torch.full((2,), float(i) + 1))


# ------------------------------------------------------------------------------ attributes of input tensors


def _sets_scale(x):
    x.scale = 2.0
    return x * x.scale


def _reads_scale(x):
    return x * getattr(x, "scale", 1.0)


def _reads_scale_strictly(x):
    return x * x.scale


def test_attribute_set_on_an_input_tensor_is_set_by_every_call():
    compiled = stampout.compile(_sets_scale, backend="eager")
    for _ in range(3):
        x = torch.ones(2)
        torch.testing.assert_close(compiled(x), torch.full((2,), 2.0))
        assert x.scale == 2.0
    assert compiled.stats.captures == 1


@pytest.mark.parametrize("fn", [_reads_scale, _reads_scale_strictly])
def test_attribute_the_caller_set_on_an_input_tensor_is_read_and_guarded(fn):
    compiled = stampout.compile(fn, backend="eager")
    x = torch.ones(2)
    x.scale = 3.0
    torch.testing.assert_close(compiled(x), torch.full((2,), 3.0))
    x.scale = 5.0
    torch.testing.assert_close(compiled(x), torch.full((2,), 5.0))
    assert compiled.stats.captures == 2


class _SetsOnInput(nn.Module):
    def __init__(self, s: float) -> None:
        super().__init__()
        self.s = s

    @stampout.region
    def forward(self, x):
        x.scale = self.s
        return x * 2


class _ReadsAfterRegion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_SetsOnInput(float(i + 1)) for i in range(3)])

    def forward(self, x):
        for block in self.blocks:
            y = x + 0
            x = block(y) * y.scale
        return x


def test_region_setting_an_attribute_on_its_input_is_not_stamped():
    model = _ReadsAfterRegion()
    x = torch.ones(2)
    cap = stampout.capture(model, x)
    torch.testing.assert_close(cap(x), model(x))
    assert cap.stats.reuses == 0


# ------------------------------------------------------------------------------- ordinary code that crashed


def _gradient_penalty(x):
    y = (x ** 2).sum()
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    return (g ** 2).sum()


def test_autograd_grad_inside_runs_eagerly_with_a_warning(caplog):
    compiled = stampout.compile(_gradient_penalty, backend="eager")
    x, ref = torch.randn(3, requires_grad=True), None
    ref = x.detach().clone().requires_grad_(True)
    with caplog.at_level(logging.WARNING):
        got = compiled(x)
    expected = _gradient_penalty(ref)
    torch.testing.assert_close(got, expected)
    got.backward()
    expected.backward()
    torch.testing.assert_close(x.grad, ref.grad)
    assert "runs eagerly" in caplog.text and "test_guard_holes.py" in caplog.text


def test_lstm_at_a_second_length_is_right():
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 5, batch_first=True)
    compiled = stampout.compile(lstm, backend="eager")
    for length in (3, 6, 7):
        x = torch.randn(2, length, 4)
        torch.testing.assert_close(compiled(x)[0], lstm(x)[0])


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @stampout.region
    def forward(self, x):
        return torch.relu(self.lin(x))


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


def _returns_graph(gm, example_inputs):
    return gm


@pytest.mark.parametrize("regions", [None, "auto"])
def test_user_backend_returning_the_graph_trains_at_two_sizes(regions):
    torch.manual_seed(0)
    model = _Blocks()
    ref = _Blocks()
    ref.load_state_dict(model.state_dict())
    compiled = stampout.compile(model, backend=_returns_graph, regions=regions)
    for n in (2, 3, 5):
        x = torch.randn(n, 4)
        compiled(x).backward()
        ref(x).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert compiled.stats.captures == 2


# ------------------------------------------------------------------------ one element, two index expressions


class _Pool:
    def __init__(self) -> None:
        self.layers = [torch.randn(4) for _ in range(4)]


class _TwoIndexes(nn.Module):
    def __init__(self, i: int, j: int) -> None:
        super().__init__()
        self.i, self.j = i, j

    @stampout.region
    def forward(self, x, pool):
        return x + pool.layers[self.i] * 2 + pool.layers[self.j]


class _TwoIndexesLocal(_TwoIndexes):
    @stampout.region
    def forward(self, x, pool):
        a = pool.layers[self.i]
        return x + a * 2 + pool.layers[self.j]


class _TwoIndexStack(nn.Module):
    def __init__(self, cls: type, indexes: list[tuple[int, int]]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([cls(i, j) for i, j in indexes])

    def forward(self, x, pool):
        for layer in self.layers:
            x = layer(x, pool)
        return x


@pytest.mark.parametrize("cls", [_TwoIndexes, _TwoIndexesLocal])
@pytest.mark.parametrize("indexes", [[(0, 0), (1, 0), (2, 0), (3, 3)], [(2, 2), (0, 1), (1, 1)]])
def test_one_element_two_indexes_is_not_stamped_as_one(cls, indexes):
    torch.manual_seed(0)
    model = _TwoIndexStack(cls, indexes)
    x, pool = torch.randn(4), _Pool()
    cap = stampout.capture(model, x, pool)
    torch.testing.assert_close(cap(x, pool), model(x, pool))
    compiled = stampout.compile(model, backend="eager")
    torch.testing.assert_close(compiled(x, pool), model(x, pool))


def _raises(x):
    raise ValueError("boom")


def test_program_error_propagates_unchanged_from_compile():
    compiled = stampout.compile(_raises, backend="eager")
    with pytest.raises(ValueError, match="boom"):
        compiled(torch.zeros(1))


def _fills_for_capture(x, cache):
    cache["k"] = x * 2
    cache.setdefault("n", 0)
    cache["x"] = x
    return x + 1


def test_capture_fills_the_callers_dict_at_capture_and_every_call():
    x = torch.ones(2)
    mine, theirs = {"old": 1}, {"old": 1}
    cap = stampout.capture(_fills_for_capture, x, mine)
    _fills_for_capture(x, theirs)
    assert _same(mine, theirs) and mine["x"] is x
    for scale in (3.0, 5.0):
        y = torch.full((2,), scale)
        mine, theirs = {"old": 1}, {"old": 1}
        torch.testing.assert_close(cap(y, mine), _fills_for_capture(y, theirs))
        assert _same(mine, theirs) and mine["x"] is y
