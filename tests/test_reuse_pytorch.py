"""PyTorch's region-reuse tests (test/higher_order_ops/test_invoke_subgraph.py, TestInvokeSubgraphReuse, the first
half: structure, attributes, closures, pytrees, constants, objects) re-expressed against stampout.

Each program is marked with `torch.compiler.nested_compile_region`, as in PyTorch, and checked by `check`:
eager vs `stampout.capture` vs `stampout.compile` (outputs, inputs after the call, gradients, the world the
program changes), with PyTorch's trace count (`traced` = traced + deduped region bodies).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import logging

import pytest
import torch
import torch.utils._pytree as pytree
from helpers import check
from torch import nn

import stampout

ncr = torch.compiler.nested_compile_region


def test_reuse_skips_tracing():
    @ncr
    def gn(x, y):
        return torch.mul(x, y)

    def fn(x, y):
        return gn(x, y) + gn(x, y) + gn(x, y)

    check(fn, torch.randn(8), torch.randn(8), traces=1, reuses=2)


def test_reuse_different_shapes():
    @ncr
    def gn(x):
        return x.sin()

    check(lambda x, y: gn(x).sum() + gn(y).sum(), torch.randn(4), torch.randn(8), traces=2, reuses=0)


class _Mod(nn.Module):
    def __init__(self, c=5):
        super().__init__()
        self.c = c

    @ncr
    def forward(self, x, y):
        return torch.mul(x, y).sin() + self.c


def test_reuse_module():
    mod = _Mod()
    check(lambda x, y: mod(x, y) + mod(x, y), torch.randn(8, requires_grad=True),
          torch.randn(8, requires_grad=True), traces=1, reuses=1, grad=True)


def test_reuse_module_different_instances():
    mod1, mod2 = _Mod(5), _Mod(5)
    check(lambda x, y: mod1(x, y) + mod2(x, y), torch.randn(8, requires_grad=True),
          torch.randn(8, requires_grad=True), traces=1, reuses=1, grad=True)


def test_reuse_tuple_output():
    @ncr
    def gn(x, y):
        return torch.sin(x), torch.cos(y)

    def fn(x, y):
        a1, a2 = gn(x, y)
        b1, b2 = gn(x, y)
        return a1 + b1, a2 + b2

    check(fn, torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True), traces=1, grad=True)


class _Scale(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.d = 100

    @ncr
    def forward(self, x):
        return x * self.c


def test_reuse_refused_after_the_read_attribute_is_mutated():
    mod = _Scale(5)

    def fn(x):
        a = mod(x)
        mod.c = 10
        return a + mod(x)

    x = torch.randn(8)
    mod.c = 5
    torch.testing.assert_close(fn(x), x * 15)
    check(fn, x, traces=2, reset=lambda: setattr(mod, "c", 5), world=lambda: mod.c)


def test_reuse_kept_when_an_unread_attribute_is_mutated():
    mod = _Scale(5)

    def fn(x):
        a = mod(x)
        mod.d = 999
        return a + mod(x)

    check(fn, torch.randn(8), traces=1, reuses=1, reset=lambda: setattr(mod, "d", 100),
          world=lambda: (mod.c, mod.d))


def test_reuse_refused_when_the_other_instance_is_mutated_before_its_call():
    sub1, sub2 = _Scale(5), _Scale(5)

    def fn(x):
        a = sub1(x)
        sub2.c = 10
        return a + sub2(x)

    check(fn, torch.randn(8), traces=2, reset=lambda: setattr(sub2, "c", 5), world=lambda: sub2.c)


def test_reuse_refused_when_an_attribute_read_before_the_region_differs():
    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c = c

    @ncr
    def apply_block(mod, x):
        return x * mod.c

    block1, block2 = Block(5), Block(10)

    def fn(x):
        a = apply_block(block1, x) if block1.c == 5 else x
        b = apply_block(block2, x) if block2.c == 10 else x
        return a + b

    check(fn, torch.randn(8), traces=2)


def test_reuse_refused_after_a_closure_object_is_mutated():
    class Config:
        def __init__(self, c):
            self.c = c

    cfg = Config(5)

    @ncr
    def apply(x):
        return x * cfg.c

    def fn(x):
        a = apply(x)
        cfg.c = 10
        return a + apply(x)

    check(fn, torch.randn(8), traces=2, reset=lambda: setattr(cfg, "c", 5), world=lambda: cfg.c)


def test_reuse_symint_arg_matches_on_its_expression():
    @ncr
    def gn(x, n):
        return x * n

    def fn(x):
        a = gn(x, x.shape[0])
        return gn(a, a.shape[0])

    cap = check(fn, torch.randn(8, 4), traces=1, reuses=1, dynamic=True)
    del cap
    compiled = stampout.compile(fn, backend="eager", dynamic=True)
    for n in (8, 5, 3):
        x = torch.randn(n, 4)
        torch.testing.assert_close(compiled(x), fn(x))
    assert compiled.stats.captures == 1


def test_reuse_transposed_buffer_with_dynamic_batch():
    class Layer(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.register_buffer("w", torch.randn(d, d))

        @ncr
        def forward(self, x):
            return torch.matmul(x, self.w.T)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer(8) for _ in range(3)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = Model()
    check(model, torch.randn(4, 8), traces=1, reuses=2, dynamic=True)
    compiled = stampout.compile(model, backend="eager", dynamic=True)
    for n in (4, 9, 2):
        x = torch.randn(n, 8)
        torch.testing.assert_close(compiled(x), model(x))
    assert compiled.stats.captures == 1


def test_reuse_refused_for_different_list_lengths():
    @ncr
    def gn(xs, ys):
        return [a + b for a, b in zip(xs, ys)]

    def fn(xs1, ys1, xs2, ys2):
        return gn(xs1, ys1), gn(xs2, ys2)

    two, three = [torch.randn(4) for _ in range(2)], [torch.randn(4) for _ in range(3)]
    check(fn, two, list(two), three, list(three), traces=2)


@dataclasses.dataclass
class _RegionInput:
    hidden: torch.Tensor


@pytest.fixture
def registered_input():
    pytree.register_pytree_node(_RegionInput, lambda v: ([v.hidden], None), lambda c, _: _RegionInput(*c))
    yield _RegionInput
    pytree.SUPPORTED_NODES.pop(_RegionInput, None)


def test_reuse_registered_dataclass_arg(registered_input):
    @ncr
    def gn(inp):
        return inp.hidden.sin()

    def fn(x):
        for _ in range(4):
            x = gn(registered_input(x))
        return x

    check(fn, torch.randn(8), traces=1, reuses=3)


def test_reuse_registered_dataclass_eight_calls(registered_input):
    @ncr
    def gn(inp):
        return inp.hidden.sin()

    def fn(x):
        for _ in range(8):
            x = gn(registered_input(x))
        return x

    check(fn, torch.randn(8), traces=1, reuses=7)


def test_reuse_pytree_flatten_fn_is_a_partial():
    @dataclasses.dataclass
    class Inp:
        hidden: torch.Tensor

    def flatten(flag, value):
        return [value.hidden], flag

    pytree.register_pytree_node(Inp, functools.partial(flatten, "cfg"), lambda c, _: Inp(*c))
    try:
        @ncr
        def gn(inp):
            return inp.hidden.cos()

        def fn(x):
            for _ in range(4):
                x = gn(Inp(x))
            return x

        check(fn, torch.randn(8), traces=1, reuses=3)
    finally:
        pytree.SUPPORTED_NODES.pop(Inp, None)


_Hidden = collections.namedtuple("_Hidden", ["hidden"])
_Left = collections.namedtuple("_Left", ["hidden"])
_Right = collections.namedtuple("_Right", ["hidden"])


def test_reuse_namedtuple_arg():
    @ncr
    def gn(inp):
        return inp.hidden.sin()

    def fn(x):
        for _ in range(4):
            x = gn(_Hidden(x))
        return x

    check(fn, torch.randn(8), traces=1, reuses=3)


def test_reuse_keeps_two_namedtuple_types_apart():
    @ncr
    def gn(inp):
        return inp.hidden.sin() if isinstance(inp, _Left) else inp.hidden.cos()

    def fn(x, y):
        return gn(_Left(x)), gn(_Right(y)), gn(_Left(y))

    check(fn, torch.randn(8), torch.randn(8), traces=2, reuses=1)


def test_reuse_registered_dataclass_kwarg(registered_input):
    @ncr
    def gn(*, inp):
        return inp.hidden.sin()

    def fn(x):
        for _ in range(4):
            x = gn(inp=registered_input(x))
        return x

    check(fn, torch.randn(8), traces=1, reuses=3)


def test_reuse_nested_pytree_arg(registered_input):
    @ncr
    def gn(d):
        b, wrapper = d["b"]
        return d["a"].sin() + b.cos() + wrapper.hidden.relu()

    def fn(x, y, z):
        for _ in range(4):
            x = gn({"a": x, "b": (y, registered_input(z))})
        return x

    check(fn, torch.randn(8), torch.randn(8), torch.randn(8), traces=1, reuses=3)


class _Opaque:
    def __init__(self, v):
        self.v = v


def test_reuse_object_made_per_call_that_the_region_ignores():
    @ncr
    def gn(pair):
        t, _ = pair
        return t.sin()

    def fn(x):
        for _ in range(4):
            x = gn((x, _Opaque(1)))
        return x

    check(fn, torch.randn(8), traces=1, reuses=3)  # never read: nothing to guard (PyTorch retraces: 4)


def test_reuse_object_made_per_call_that_the_region_reads():
    @ncr
    def gn(pair):
        t, o = pair
        return t.sin() * o.v

    def fn(x):
        for i in range(4):
            x = gn((x, _Opaque(i + 1)))
        return x

    check(fn, torch.randn(8), traces=4, reuses=0)  # o.v is read and differs on every call


def test_reuse_object_leaf_from_the_caller():
    @ncr
    def gn(pair):
        t, _ = pair
        return t.sin()

    def fn(pair):
        out = pair[0]
        for _ in range(4):
            out = gn((out, pair[1]))
        return out

    check(fn, (torch.randn(8), _Opaque(1)), traces=1, reuses=3)


def test_pytree_registry_changed_after_compile_stays_correct():
    @dataclasses.dataclass
    class Inp:
        hidden: torch.Tensor

    pytree.register_pytree_node(Inp, lambda v: ([v.hidden], None), lambda c, _: Inp(*c))

    @ncr
    def gn(inp):
        return inp.hidden.sin()

    def fn(x):
        for _ in range(4):
            x = gn(Inp(x))
        return x

    compiled = stampout.compile(fn, backend="eager")
    x1 = torch.randn(8)
    torch.testing.assert_close(compiled(x1), fn(x1))
    pytree.SUPPORTED_NODES.pop(Inp, None)
    x2 = torch.randn(8)
    torch.testing.assert_close(compiled(x2), fn(x2))


def test_reuse_refused_for_three_constants():
    @ncr
    def gn(x, scale):
        return x * scale

    check(lambda x: (gn(x, 1), gn(x, 2), gn(x, 3)), torch.randn(4), traces=3, reuses=0)


def test_reuse_tuple_outputs_threaded_through_layers():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8, bias=False)

        @ncr
        def forward(self, x, residual):
            h = self.linear(x) + residual
            return h, h * 0.5

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(8, 8, bias=False)
            self.layers = nn.ModuleList([Layer() for _ in range(3)])

        def forward(self, x, residual):
            x, residual = self.embed(x), self.embed(residual)
            for layer in self.layers:
                x, residual = layer(x, residual)
            return x, residual

    check(Model(), torch.randn(4, 8), torch.randn(4, 8), traces=1, reuses=2, grad=True)


def test_reuse_refused_for_two_distinct_symbols():
    @ncr
    def gn(x, n):
        return x * n

    check(lambda x: (gn(x, x.shape[0]), gn(x, x.shape[1])), torch.ones(4, 6), traces=2, dynamic=True)


def test_reuse_cache_keeps_several_entries():
    @ncr
    def gn(x):
        return x.sin()

    check(lambda a, b, c: (gn(a), gn(b), gn(c)), torch.randn(4), torch.randn(8), torch.randn(4),
          traces=2, reuses=1)


def test_reuse_keyword_argument():
    @ncr
    def gn(x, *, scale=1.0):
        return x * scale

    check(lambda x: gn(x, scale=2.0) + gn(x, scale=2.0), torch.randn(8), traces=1, reuses=1)


def test_reuse_past_max_entries_raises(caplog):
    @ncr(max_reuse_entries=2)
    def gn(x, c):
        return x * c

    def fn(x):
        return gn(x, 1) + gn(x, 2) + gn(x, 3)

    x = torch.randn(4)
    with pytest.raises(stampout.StampoutError, match="max_reuse_entries=2"):
        stampout.capture(fn, x)
    with pytest.raises(stampout.StampoutError, match="max_reuse_entries=2"):
        stampout.compile(fn, backend="eager", fullgraph=True)(x)
    with caplog.at_level(logging.WARNING, logger="stampout"):  # without fullgraph: that region runs eagerly
        torch.testing.assert_close(stampout.compile(fn, backend="eager")(x), fn(x))
    assert "max_reuse_entries=2" in caplog.text


class _Mode(enum.IntEnum):
    ADD = 1
    SUB = 2


@ncr
def _by_mode(x, mode):
    return x.sin() if mode == _Mode.ADD else x.cos()


@pytest.mark.parametrize("mode", [_Mode.ADD, _Mode.SUB])
def test_reuse_enum_arg(mode):
    check(lambda x: _by_mode(x, mode) + _by_mode(x, mode), torch.randn(8), traces=1, reuses=1)


def test_reuse_refused_for_distinct_enum_members():
    check(lambda x: _by_mode(x, _Mode.ADD) + _by_mode(x, _Mode.SUB), torch.randn(8), traces=2)


@ncr
def _is_mode(x, c):
    return x.sin() if isinstance(c, _Mode) else x.cos()


@ncr
def _is_bool(x, c):
    return x.sin() if isinstance(c, bool) else x.cos()


@pytest.mark.parametrize("fn", [lambda x: _is_mode(x, _Mode.ADD) + _is_mode(x, 1),
                                lambda x: _is_bool(x, True) + _is_bool(x, 1)], ids=["enum-int", "bool-int"])
def test_reuse_refused_for_equal_constants_of_different_types(fn):
    check(fn, torch.randn(8), traces=2, reuses=0)


class _Batch:
    def __init__(self, delta):
        self.delta = delta


@ncr
def _add_delta(x, batch):
    return x.sin() + batch.delta


def test_reuse_user_object_arg():
    check(lambda x, b: _add_delta(x, b) + _add_delta(x, b), torch.randn(8), _Batch(torch.randn(8)),
          traces=1, reuses=1)


def test_reuse_two_user_objects_with_equal_metadata():
    check(lambda x, b1, b2: _add_delta(x, b1) + _add_delta(x, b2), torch.randn(8), _Batch(torch.randn(8)),
          _Batch(torch.randn(8)), traces=1, reuses=1)


def test_reuse_refused_for_user_objects_with_different_metadata():
    check(lambda x, b1, b2: _add_delta(x, b1) + _add_delta(x, b2), torch.randn(8), _Batch(torch.randn(8)),
          _Batch(torch.randn(1)), traces=2)


def test_reuse_user_object_made_inside_the_program():
    check(lambda x: _add_delta(x, _Batch(x.cos())) + _add_delta(x, _Batch(x.cos() * 2)), torch.randn(8),
          traces=1, reuses=1)  # its tensor is an activation of each call, not baked (PyTorch retraces: 2)


class _HoistedString:
    """A value-type opaque object a custom op takes (PyTorch's test_opaque_obj_v2.HoistedString)."""

    def __init__(self, s):
        self.s = s

    def __eq__(self, other):
        return isinstance(other, _HoistedString) and other.s == self.s

    def __hash__(self):
        return hash(self.s)

    def __fx_repr__(self):
        return f"_HoistedString({self.s!r})", {"_HoistedString": _HoistedString}


@pytest.fixture(scope="module")
def op_with_string():
    from torch._library.opaque_object import get_opaque_type_name, register_opaque_type

    register_opaque_type(_HoistedString, typ="value", hoist=True)
    with torch.library._scoped_library("stampout_reuse_opaque", "FRAGMENT") as lib:
        lib.define(f"op_with_string(Tensor x, {get_opaque_type_name(_HoistedString)} s) -> Tensor")
        lib.impl("op_with_string", lambda x, s: x * 2 if s.s == "double" else x * x, "CompositeExplicitAutograd")
        yield torch.ops.stampout_reuse_opaque.op_with_string


def test_reuse_region_building_an_opaque_object(op_with_string):
    gn = ncr(lambda x: op_with_string(x, _HoistedString("double")))
    check(lambda x: gn(x) + gn(x), torch.randn(8), traces=1, reuses=1)


def test_reuse_opaque_objects_with_different_arguments(op_with_string):
    class Layer(nn.Module):
        def __init__(self, name):
            super().__init__()
            self.name = name

        @ncr
        def forward(self, x):
            return op_with_string(x, _HoistedString(self.name))

    # the string is a guarded constant of the trace (PyTorch hoists it into an input: 1 trace)
    check(nn.Sequential(Layer("double"), Layer("square"), Layer("double")), torch.randn(8), traces=2, reuses=1,
          backend="aot_eager")
