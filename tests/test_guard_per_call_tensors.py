"""The per-call check of tensors held by inputs (a KV cache's layers): their metadata is checked in one C++ call
(guards.DeferredTensors), a cache layer is found by its layer's index read from an anchor, and constants are
compared by exact type. Each test changes one thing a trace depended on and expects eager's result (a
recapture), and that the cheaper checks still admit the unchanged call without one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout


class Layer:
    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys
        self.scale = 2
        self.mode = "add"
        self.on = True


class Cache:
    def __init__(self, layers: list[Layer]) -> None:
        self.layers = layers


class Block(nn.Module):
    def __init__(self, idx: int) -> None:
        super().__init__()
        self.idx = idx
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        layer = cache.layers[self.idx]
        k = layer.keys
        y = self.lin(x) + k.sum(0).float() * layer.scale
        if layer.mode == "add" and layer.on:
            y = y + k.shape[0]
        return y


class Model(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(i) for i in range(n))

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, cache)
        return x


def cache_of(n: int = 3, rows: int = 2) -> Cache:
    return Cache([Layer(torch.randn(rows, 4)) for _ in range(n)])


def setup():
    torch.manual_seed(0)
    model = Model()
    fn = stampout.compile(model, backend="eager")
    x = torch.randn(2, 4)
    cache = cache_of()
    with torch.no_grad():
        torch.testing.assert_close(fn(x, cache), model(x, cache))
        torch.testing.assert_close(fn(x, cache), model(x, cache))
    return model, fn, x, cache


def check(model, fn, x, cache) -> None:
    with torch.no_grad():
        torch.testing.assert_close(fn(x, cache), model(x, cache))


def test_unchanged_cache_and_a_new_equal_cache_do_not_recapture():
    model, fn, x, cache = setup()
    check(model, fn, x, cache_of())  # another cache of the same metadata: admitted
    assert fn.stats.captures == 1


def test_cache_tensor_shape_change_recaptures():
    model, fn, x, cache = setup()
    cache.layers[2].keys = torch.randn(3, 4)  # (its row count is read as a constant)
    check(model, fn, x, cache)
    assert fn.stats.captures == 2


def test_cache_tensor_dtype_stride_offset_and_grad_changes_are_seen():
    model, fn, x, cache = setup()
    for keys in (torch.randn(2, 4, dtype=torch.float64), torch.randn(4, 2).t(), torch.randn(12)[4:].view(2, 4),
                 torch.randn(2, 4).requires_grad_()):
        before = fn.stats.captures
        cache.layers[1].keys = keys
        check(model, fn, x, cache)
        assert fn.stats.captures == before + 1, keys


def test_cache_tensor_subclass_is_seen():
    model, fn, x, cache = setup()
    cache.layers[0].keys = nn.Parameter(torch.randn(2, 4), requires_grad=False)
    check(model, fn, x, cache)
    assert fn.stats.captures == 2


def test_one_tensor_held_by_two_layers_is_checked_exactly():
    """TensorGuards rejects a tensor listed twice: the exact check decides, eager's result. The layers' tensors
    becoming one tensor is an aliasing change (the capture had them distinct): one recapture, then stable."""
    model, fn, x, cache = setup()
    shared = torch.randn(2, 4)
    for layer in cache.layers:
        layer.keys = shared
    check(model, fn, x, cache)
    check(model, fn, x, cache)
    assert fn.stats.captures == 2
    cache.layers[1].keys = torch.randn(5, 4)
    check(model, fn, x, cache)
    assert fn.stats.captures == 3


def test_new_layer_and_lost_layer_are_seen():
    model, fn, x, cache = setup()
    cache.layers.append(Layer(torch.randn(2, 4)))
    check(model, fn, x, cache)  # (the length of the list is guarded)
    cache.layers.pop()
    cache.layers.pop()
    with torch.no_grad(), pytest.raises(IndexError):
        model(x, cache)
    with torch.no_grad(), pytest.raises(IndexError):
        fn(x, cache)


def test_constants_of_a_cache_layer_flip_between_calls():
    for name, value in (("scale", 3), ("scale", 2.0), ("scale", True), ("mode", "mul"), ("on", False),
                        ("on", None), ("on", 1)):
        model, fn, x, cache = setup()  # (fresh: an int seen to change is captured as a symbol next)
        setattr(cache.layers[1], name, value)
        check(model, fn, x, cache)
        assert fn.stats.captures == 2, (name, value)


def test_layer_index_written_on_the_module_moves_the_slot_read():
    """`cache.layers[self.idx]`: the index is an anchor (re-read after a write to the module), not a walk."""
    model, fn, x, cache = setup()
    cache.layers[0].keys = torch.randn(2, 4)  # same metadata, other values
    model.blocks[2].idx = 0  # now reads layer 0's keys
    check(model, fn, x, cache)
    model.blocks[2].__dict__["idx"] = 1  # a write that bypasses __setattr__: the module's dict version moves
    check(model, fn, x, cache)


class Appending(nn.Module):
    """Each block stores a tensor on itself (a watched module: the store moves EPOCH) and then a new tensor
    on its cache layer, as a dynamic cache's update does: the stores are replayed after every compiled call."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(i) for i in range(n))

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, cache)
            if i == 1:
                block.last = x * 1
            layer = cache.layers[block.idx]
            layer.keys = torch.cat([layer.keys[1:], x[:1]])
        return x


def test_replayed_stores_match_eager_before_and_after_a_store_that_moves_epoch():
    torch.manual_seed(0)
    model, reference = Appending(), Appending()
    reference.load_state_dict(model.state_dict())
    fn = stampout.compile(model, backend="eager")
    x = torch.randn(2, 4)
    ours, theirs = cache_of(), cache_of()
    for a, b in zip(ours.layers, theirs.layers):
        b.keys = a.keys.clone()
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(fn(x, ours), reference(x, theirs))
            for a, b in zip(ours.layers, theirs.layers):
                torch.testing.assert_close(a.keys, b.keys)
            torch.testing.assert_close(model.blocks[1].last, reference.blocks[1].last)
        model.blocks[2].idx = reference.blocks[2].idx = 0  # block 2 now stores into layer 0
        for _ in range(2):
            torch.testing.assert_close(fn(x, ours), reference(x, theirs))
            for a, b in zip(ours.layers, theirs.layers):
                torch.testing.assert_close(a.keys, b.keys)
    assert fn.stats.captures <= 3


class _Holder:
    def __init__(self, t):
        self.t = t


def _scaled_by_offset(holder, x):
    return x * holder.t.storage_offset() + holder.t.sum()


def test_a_held_tensor_at_another_storage_offset_is_seen_after_repeated_calls():
    # (sizes, strides, dtype: equal; only the storage offset the trace baked in differs; the C++ metadata
    # check does not compare offsets: guards.DeferredTensors does)
    compiled = stampout.compile(_scaled_by_offset, backend="eager")
    base = torch.arange(10.0)
    holder = _Holder(base[1:4])
    for _ in range(3):
        torch.testing.assert_close(compiled(holder, torch.ones(3)), _scaled_by_offset(holder, torch.ones(3)))
    holder.t = base[5:8]
    torch.testing.assert_close(compiled(holder, torch.ones(3)), _scaled_by_offset(holder, torch.ones(3)))

class _Box:
    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b


def _bump_a_read_b(x, box):
    box.a.add_(1.0)
    return x + box.b


def test_tensors_held_by_an_input_object_that_become_aliased_recapture():
    compiled = stampout.compile(_bump_a_read_b, backend="aot_eager")
    x = torch.ones(4)
    compiled(x, _Box(torch.zeros(4), torch.zeros(4)))
    t, t_eager = torch.zeros(4), torch.zeros(4)
    out = compiled(x, _Box(t, t))
    expected = _bump_a_read_b(x, _Box(t_eager, t_eager))
    torch.testing.assert_close(t, t_eager)
    torch.testing.assert_close(out, expected)  # got x + 0: b read as it was before a.add_(1)


def test_tensors_held_by_an_input_object_that_become_overlapping_views_recapture():
    compiled = stampout.compile(_bump_a_read_b, backend="aot_eager")
    x = torch.ones(4)
    disjoint = torch.zeros(8)
    compiled(x, _Box(disjoint[:4], disjoint[4:]))
    base, base_eager = torch.zeros(8), torch.zeros(8)
    out = compiled(x, _Box(base[:4], base[2:6]))  # distinct objects, overlapping bytes
    expected = _bump_a_read_b(x, _Box(base_eager[:4], base_eager[2:6]))
    torch.testing.assert_close(base, base_eager)
    torch.testing.assert_close(out, expected)


def test_a_tensor_held_by_an_input_object_that_becomes_the_input_recaptures():
    def f(x, box):
        x.add_(1.0)
        return box.b * 2

    compiled = stampout.compile(f, backend="aot_eager")
    compiled(torch.zeros(4), _Box(torch.zeros(4), torch.zeros(4)))
    t, t_eager = torch.zeros(4), torch.zeros(4)
    out = compiled(t, _Box(torch.zeros(4), t))
    torch.testing.assert_close(out, f(t_eager, _Box(torch.zeros(4), t_eager)))


def test_input_leaves_that_become_aliased_recapture():
    # (passes: the fingerprint of pytree leaves keeps which alias, capture.aliases_of; the control for the above)
    def f(x, items):
        items[0].add_(1.0)
        return x + items[1]

    compiled = stampout.compile(f, backend="aot_eager")
    x = torch.ones(4)
    compiled(x, [torch.zeros(4), torch.zeros(4)])
    t, t_eager = torch.zeros(4), torch.zeros(4)
    torch.testing.assert_close(compiled(x, [t, t]), f(x, [t_eager, t_eager]))
    torch.testing.assert_close(t, t_eager)
