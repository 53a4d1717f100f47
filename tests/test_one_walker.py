"""One walker over an op's arguments and results (structure.leaves_of / map_leaves), used by tensors_of, the
known constants' real values and the per-layer slots a torch call uses; and the cases where the FX-argument
walkers (builder.map_tensors / has_tensor, Recording.bind_outputs) disagreed with it: tuple subclasses, nesting.
And one walk over the values a value holds (structure.found_within), used by the world scan's holds_fake, the
fakes taken out of functools caches and the tensors a region leaves outside its outputs (tensors_within)."""

from __future__ import annotations

import collections
import types
from collections import OrderedDict

import torch

from stampout import config
from stampout.trace.structure import found_within, leaves_of, map_leaves, tensors_of, tensors_within

Pair = collections.namedtuple("Pair", ["a", "b"])


def test_leaves_in_order_through_tuples_lists_dicts_and_subclasses():
    x, y, z = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    value = (x, [1, {"k": y}], OrderedDict(v=Pair(z, 3)), torch.Size([4]))
    assert [id(t) for t in tensors_of(value)] == [id(x), id(y), id(z)]
    assert leaves_of(value, int) == [1, 3, 4]


def test_map_leaves_keeps_the_containers():
    x = torch.zeros(2)
    def bump(v):
        return v + 1 if isinstance(v, torch.Tensor) else v

    out = map_leaves((x, [x], {"k": Pair(x, 1)}, torch.Size([3])), bump)
    assert type(out) is tuple and type(out[1]) is list and type(out[2]["k"]) is Pair and out[2]["k"].b == 1
    assert type(out[3]) is torch.Size and out[3] == torch.Size([3])
    assert torch.equal(out[2]["k"].a, torch.ones(2))
    values = torch.max(torch.tensor([[1.0, 3.0]]), dim=1)  # a structseq: built from one sequence
    mapped = map_leaves(values, lambda v: v * 2)
    assert type(mapped) is type(values) and mapped.values.item() == 6.0


def test_a_namedtuple_of_tensors_passed_to_an_op_matches_eager():
    # builder.has_tensor opened tuple subclasses but builder.map_tensors did not: torch.cat(Pair(a, b)) ran on the
    # fakes inside the namedtuple and the graph baked them in as a constant (the capture returned a FakeTensor).
    from helpers import check_capture

    def cat(x, y):
        return torch.cat(Pair(x * 2, y + 1)) * 3

    def stack(x, y):
        return torch.stack(Pair(x, y)).sum(0)

    for fn in (cat, stack):
        cap = check_capture(fn, torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True))
        cap.gm.graph.lint()


def test_a_structseq_passed_back_to_an_op_matches_eager():
    from helpers import check_capture

    def fn(x):
        top = torch.max(x, dim=1)  # torch.return_types.max: a tuple subclass without _make
        return torch.stack(top).sum(0) + top.values

    check_capture(fn, torch.randn(2, 4, requires_grad=True))


def test_tensors_nested_in_an_ops_result_are_bound():
    # Tracer.bind_outputs opened one level of an op's result: histogramdd's (hist, [edges, ...]) left the edges
    # unrecorded, and using one raised "a fake tensor ... reached the graph without being recorded".
    from helpers import check_capture

    def fn(x):
        hist, edges = torch.histogramdd(x, bins=[2, 3], range=[0.0, 1.0, 0.0, 1.0])
        return hist.sum() + edges[1].sum() * x.sum()

    cap = check_capture(fn, torch.rand(8, 2), grad=False)
    cap.gm.graph.lint()


def test_found_within_opens_containers_and_plain_objects_to_the_configured_depth_and_size():
    wanted = lambda v: isinstance(v, torch.Tensor)  # noqa: E731
    x = torch.zeros(1)
    holder = types.SimpleNamespace(inner={"k": [x]}, shut=lambda: x, more=frozenset({(x,)}))
    assert [id(t) for t in found_within(holder, wanted)] == [id(x), id(x)]  # (not the lambda's closure)
    with config.patch(scan_depth=2):
        assert found_within(holder, wanted) == []  # (holder, dict, list: x is three levels down)
    with config.patch(scan_items=2):
        assert found_within(holder, wanted) == []  # (holder has three attributes)
    assert found_within(holder, wanted, first=True) == [x]
    deep = [[[[x]]]]
    assert found_within(deep, wanted) == [] and tensors_within(deep) == [x]  # (tensors_within: four levels)


_GLOBAL_TENSOR = torch.zeros(1)


def test_the_whole_walk_opens_any_object_but_not_the_program():
    # found_within(whole=True): what a capture hands back or leaves behind, searched entirely (closures, partials,
    # bound methods, modules, __slots__, dict keys, any depth and size), but not through a function's globals, a
    # class or a Python module: a walk from one lambda does not visit the whole program.
    import functools

    wanted = lambda v: isinstance(v, torch.Tensor)  # noqa: E731
    x = torch.ones(1)
    m = torch.nn.Module()
    m.t = x

    class Slotted:
        __slots__ = ("t",)

    s = Slotted()
    s.t = x
    for holder in ((lambda: x), functools.partial(torch.add, x), m, [m], s, {x: 1}, [[[[[[x]]]]]],
                   [0] * 1000 + [x], types.SimpleNamespace(f=lambda: x), Pair(1, [x]),
                   {**{f"w{i}": i for i in range(1000)}, "t": [x]}):  # (a vocabulary: its atomic items in one pass)
        assert found_within(holder, wanted, whole=True) == [x], holder
    top = torch.max(x.reshape(1, 1), dim=1)  # (a tuple subclass defined in torch: opened all the same)
    assert len(found_within([top], wanted, whole=True)) == 2
    uses_global = lambda: _GLOBAL_TENSOR  # noqa: E731
    assert found_within(uses_global, wanted, whole=True) == []
    assert found_within([Slotted, types, torch], wanted, whole=True) == []


def test_the_whole_walk_leaves_the_import_system_and_the_builtins_shut():
    # A module's globals name its loader (under pytest the assertion rewriter, which reaches the whole test session:
    # every capture's world repair walked it) and the builtins' namespace: no program state, each one object to the
    # walk. Its spec is opened, but the loader it names stays shut: a few objects.
    seen: list = []
    for name in ("__loader__", "__builtins__"):
        seen.clear()
        assert found_within(globals()[name], lambda v: seen.append(v) is not None, whole=True) == []
        assert len(seen) == 1, (name, len(seen))
    seen.clear()
    assert found_within(globals()["__spec__"], lambda v: seen.append(v) is not None, whole=True) == []
    assert __loader__ in seen and len(seen) < 8, len(seen)


def test_a_traced_value_stored_on_a_modules_spec_is_found():
    """The whole walk opens a module's spec (was: shut with the import system's loaders, so a program storing on it
    left a fake there after stampout.capture, and STAMPOUT_CHECK_WORLD did not see it)."""
    import json

    import stampout

    def program(x):
        json.__spec__.rt_stash = x * 2
        return x + 1

    x = torch.randn(3)
    try:
        stampout.capture(program, x)
        assert type(json.__spec__.rt_stash) is torch.Tensor, type(json.__spec__.rt_stash)
        torch.testing.assert_close(json.__spec__.rt_stash, x * 2)
        fn = stampout.compile(program, backend="eager")
        for _ in range(3):
            x = torch.randn(3)
            torch.testing.assert_close(fn(x), x + 1)
            assert type(json.__spec__.rt_stash) is torch.Tensor
            torch.testing.assert_close(json.__spec__.rt_stash, x * 2)
    finally:
        json.__spec__.__dict__.pop("rt_stash", None)
