"""Symbolic sizes: mark_dynamic / mark_static, compile(dynamic=None|True|False), shape guards, reuse across
the layers with symbolic inputs, and values and gradients equal to eager for every size."""

from __future__ import annotations

import copy

import pytest
import torch
from dynamic_models import LENGTHS, Stack, dynamic_input
from helpers import tree_assert_close
from torch import nn

import stampout


# ---- capture ---------------------------------------------------------------------------------------------
def test_mark_dynamic_capture_serves_every_length():
    model = Stack()
    cap = stampout.capture(model, dynamic_input(8))
    assert (cap.stats.traces, cap.stats.reuses, cap.stats.subgraphs) == (1, 3, 1)
    for t in LENGTHS:
        x = torch.randn(2, t, 16)
        out, ref = cap(x), model(x)
        tree_assert_close(out, ref)
        assert out[1] == torch.Size([2, t, 16]) and out[2] == 2 * t  # sizes come from the graph, not baked
    assert "sym_size" in cap.gm.code
    cap.gm.graph.lint()
    assert "symbolic sizes; the capture serves every input for which this holds: x.size(0) == 2" in cap.explain()


def test_constants_stay_constants():
    """LayerNorm's eps is a float constant in the subgraph (torch.compile's dynamic=True makes it a SymFloat)."""
    cap = stampout.capture(Stack(2), dynamic_input(8))
    code = cap.gm.subgraph_0.code
    assert "eps = 1e-05" in code


def test_symbolic_capture_refuses_sizes_outside_its_assumptions():
    cap = stampout.capture(Stack(2), dynamic_input(8))
    with pytest.raises(stampout.StampoutError) as error:
        cap(torch.randn(3, 8, 16))  # the batch dim was captured static
    text = str(error.value)
    assert "x.size(0) == 2" in text and "[3, 8, 16]" in text and "test_dynamic.py" in text
    with pytest.raises(stampout.StampoutError, match=r"x.size\(1\)"):
        cap(torch.randn(2, 1, 16))  # 0/1 are specialized: a length of 1 is outside the capture


def test_static_capture_names_the_input_that_differs():
    cap = stampout.capture(Stack(2), torch.randn(2, 8, 16))
    with pytest.raises(stampout.StampoutError, match=r"input x differs.*shape=\[2, 8, 16\].*got shape=\[2, 5, 16\]"):
        cap(torch.randn(2, 5, 16))


def test_mark_static_wins_over_dynamic_true():
    model = Stack(2)
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager", dynamic=True)
    for t in (6, 9):
        x = torch.randn(2, t, 16)
        torch._dynamo.mark_static(x, 1)
        tree_assert_close(fn(x), reference(x))
    assert fn.stats.captures == 2


class SizeArgument(nn.Module):
    """A region that takes a symbolic size as an argument (PyTorch's SymInt-argument reuse test)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    @stampout.region
    def step(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return self.fc(x).narrow(1, 0, n) * n

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = self.step(x, x.shape[1] // 2)
        b = self.step(x, x.shape[1] // 2)  # same expression: reused
        c = self.step(y, y.shape[1] // 2)  # another symbol: another trace
        return a.sum(1) + b.sum(1) + c.sum(1)


def test_region_fingerprint_by_symbol():
    model = SizeArgument()
    x, y = torch.randn(2, 8, 16), torch.randn(2, 6, 16)
    torch._dynamo.mark_dynamic(x, 1)
    torch._dynamo.mark_dynamic(y, 1)
    cap = stampout.capture(model, x, y)
    assert (cap.stats.traces, cap.stats.reuses) == (2, 1)
    for tx, ty in ((8, 6), (10, 4), (5, 12)):
        x, y = torch.randn(2, tx, 16), torch.randn(2, ty, 16)
        tree_assert_close(cap(x, y), model(x, y))


class Branchy(nn.Module):
    """Python decides on a size inside the region: the decision is a shape guard, never baked."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 10:
            return self.fc(x)[:, :10]
        return self.fc(x) * 2


def test_size_decision_is_guarded():
    model = Branchy()
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager", dynamic=True)
    for t in (4, 6, 12, 16, 8, 11, 10):
        x = torch.randn(2, t, 16)
        tree_assert_close(fn(x), reference(x))
    assert fn.stats.captures == 2  # one capture for t <= 10, one for t > 10


def test_transposed_input_is_guarded_on_strides():
    model = Stack(2)
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager", dynamic=True)
    x = torch.randn(2, 8, 16)
    tree_assert_close(fn(x), reference(x))
    xt = torch.randn(2, 16, 10).transpose(1, 2)  # same sizes pattern, other strides
    tree_assert_close(fn(xt), reference(xt))
    assert fn.stats.captures == 2


class RemembersLength(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.length = None
        self.history: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.length = x.shape[1]
        self.history.append(x.shape[1] * 2)
        self.shape = x.shape
        return self.fc(x)


@pytest.mark.parametrize("dynamic", [None, True])
def test_sizes_stored_on_the_model_are_the_calls_ints(dynamic):
    model = RemembersLength()
    fn = stampout.compile(model, backend="eager", dynamic=dynamic)
    for t in (3, 5, 7, 4):
        fn(torch.randn(2, t, 16))
        assert type(model.length) is int and model.length == t
        assert type(model.shape) is torch.Size and model.shape == (2, t, 16)
    assert model.history == [6, 10, 14, 8] and all(type(v) is int for v in model.history)


def test_capture_leaves_no_symbolic_size_on_the_model():
    model = RemembersLength()
    stampout.capture(model, dynamic_input(6))
    assert type(model.length) is int and model.length == 6
    assert model.history == [12] and type(model.history[0]) is int
    assert model.shape == (2, 6, 16) and all(type(s) is int for s in model.shape)


class Slot:
    def __init__(self) -> None:
        self.keys = torch.zeros(1, 2, 0, 8)


class GrowingCache:
    """A KV cache that grows by `torch.cat` and attribute assignment (as transformers' DynamicCache does)."""

    def __init__(self, n: int) -> None:
        self.layers = [Slot() for _ in range(n)]


class CachedLayer(nn.Module):
    def __init__(self, idx: int) -> None:
        super().__init__()
        self.idx = idx
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, cache: GrowingCache) -> torch.Tensor:
        k = self.proj(x).view(1, 2, -1, 8)
        slot = cache.layers[self.idx]
        slot.keys = torch.cat([slot.keys, k], dim=2)
        att = (k @ slot.keys.transpose(-1, -2)).softmax(-1) @ slot.keys
        return x + att.reshape(x.shape)


class CachedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(CachedLayer(i) for i in range(3))

    def forward(self, x: torch.Tensor, cache: GrowingCache) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, cache)
        return x


@pytest.mark.parametrize("backend,dynamic", [("eager", None), ("aot_eager", None), ("eager", True)])
def test_a_growing_cache_held_by_an_input_object_is_captured_symbolic(backend, dynamic):
    """Prefill, then decode steps: the cache tensors the program reads through its input object grow by one
    each call; the decode capture after the first size change serves every later length (dynamic=True too:
    held tensors are found by a capture, so they become symbolic at their first change)."""
    model = CachedStack()
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend=backend, dynamic=dynamic)
    cache, expected_cache = GrowingCache(3), GrowingCache(3)
    for step in range(7):
        x = torch.randn(1, 1 if step else 5, 16)
        with torch.no_grad():
            tree_assert_close(fn(x, cache), reference(x, expected_cache))
        for a, b in zip(cache.layers, expected_cache.layers):
            torch.testing.assert_close(a.keys, b.keys)
    assert fn.stats.captures == 2  # prefill, then one symbolic decode capture for every cache length
    assert fn.last_capture.shapes is not None and "cache.layers[0].keys" in fn.last_capture.shapes.describe()


class Holder:
    pass


HELD = Holder()


def _stores_sizes_everywhere(x: torch.Tensor) -> torch.Tensor:
    global STORED
    t = x.shape[0]
    HELD.n = t
    HELD.sub.n = t - 1
    HELD.items.append(t * 3)
    HELD.table["k"] = t + 7
    STORED = t + 1
    return x * 2


def test_capture_leaves_ints_wherever_the_program_stored_a_size():
    HELD.sub, HELD.items, HELD.table = Holder(), [], {}
    x = torch.randn(5, 3)
    torch._dynamo.mark_dynamic(x, 0)
    cap = stampout.capture(_stores_sizes_everywhere, x)
    assert cap.shapes is not None
    assert (HELD.n, HELD.sub.n, HELD.items, HELD.table, STORED) == (5, 4, [15], {"k": 12}, 6)
    assert all(type(v) is int for v in (HELD.n, HELD.sub.n, HELD.items[0], HELD.table["k"], STORED))


@stampout.region
def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x * 2
    t = x.shape[0]
    return h[: t // 2], h[t // 2 :]


def test_views_of_one_region_output_with_symbolic_bounds():
    def f(x):
        a, b = _halves(x)
        return a + 1, b + 1

    fn = stampout.compile(f, backend="eager", dynamic=True)
    for n in (6, 9, 4):
        x = torch.randn(n, 3)
        tree_assert_close(fn(x), f(x))
    assert fn.stats.captures == 1


def test_a_dict_holding_a_replaced_tensor_is_compiled():
    def make():
        cache = {"k": torch.zeros(4, 3)}

        def f(x):
            cache["k"] = torch.cat([cache["k"], x])[-4:]
            return cache["k"].sum(0)

        return f, cache

    (f, cache), (g, expected) = make(), make()
    fn = stampout.compile(f, backend="eager")
    for i in range(4):
        x = torch.randn(1, 3, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(fn(x), g(x))
        torch.testing.assert_close(cache["k"], expected["k"])


class GrowsItsOwnCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.cache = torch.zeros(0, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache = torch.cat([self.cache, self.fc(x)])
        return self.cache.sum(0)


def test_a_cache_the_module_grows_is_captured_symbolic():
    model = GrowsItsOwnCache()
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager")
    for i in range(8):
        x = torch.randn(1, 4, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            torch.testing.assert_close(fn(x), reference(x))
        torch.testing.assert_close(model.cache, reference.cache)
    assert fn.stats.captures == 3  # lengths 0 and 1 are static (0/1 specialization), then one for all others


class CountsCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.fc(x) * 2
        return y if self.calls < 5 else y + 1


class Position:
    def __init__(self) -> None:
        self.pos = 0


def _advance(x: torch.Tensor, p: Position) -> torch.Tensor:
    out = x + p.pos
    if p.pos >= 3:
        out = out - 1
    p.pos += x.shape[0]
    return out


def test_an_int_counter_becomes_a_symbolic_int():
    """An int the program reads and advances (a call counter, a cache position): after it changes once it is an
    input of the graph, read per call, and its branches are shape guards, instead of a capture per value."""
    model = CountsCalls()
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager")
    for i in range(10):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            torch.testing.assert_close(fn(x), reference(x))
        assert type(model.calls) is int and model.calls == reference.calls
    assert fn.stats.captures <= 4  # 0 and 1 static, then one per side of `calls < 5`

    fn = stampout.compile(_advance, backend="eager")
    p, expected = Position(), Position()
    for i in range(10):
        x = torch.randn(1, 4, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(fn(x, p), _advance(x, expected))
        assert type(p.pos) is int and p.pos == expected.pos
    assert fn.stats.captures <= 4


class _Row:
    def __init__(self) -> None:
        self.k = torch.zeros(0, 4)


@stampout.region
def _append_and_mean(x: torch.Tensor, row: _Row) -> torch.Tensor:
    row.k = torch.cat([row.k, x])
    return x + row.k.sum(0) / row.k.shape[0]


def _rows_program(x: torch.Tensor, rows: list) -> torch.Tensor:
    for row in rows:
        x = _append_and_mean(x, row)
    return x


def test_held_tensors_whose_lengths_part_ways_are_not_stamped_with_one_symbol():
    fn = stampout.compile(_rows_program, backend="eager")
    rows, expected = [_Row(), _Row()], [_Row(), _Row()]
    for i in range(6):
        if i == 3:  # the second row grows by two more: the two lengths differ from now on
            for r in (rows, expected):
                r[1].k = torch.cat([r[1].k, torch.ones(2, 4)])
        x = torch.randn(1, 4, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(fn(x, rows), _rows_program(x, expected))


class Counter:
    def __init__(self) -> None:
        self.n = 0


def _remember_length(x: torch.Tensor, counter: Counter) -> torch.Tensor:
    counter.n = x.shape[0]
    return x * 2


def test_a_capture_stores_each_calls_size_on_its_input_object():
    """A size the program stores on an input object is the call's own, not the capture's (a KV cache's length)."""
    x = torch.randn(5)
    torch._dynamo.mark_dynamic(x, 0)
    mine = Counter()
    cap = stampout.capture(_remember_length, x, mine)
    assert mine.n == 5 and type(mine.n) is int
    for n in (7, 3):
        other = Counter()
        cap(torch.randn(n), other)
        assert other.n == n and type(other.n) is int
