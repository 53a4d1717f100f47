"""SPEC §5: region reuse with exact trace counts, each checked against eager (values, and grads)."""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_matches_eager
from torch import nn

import stampout


# ---- functions ----------------------------------------------------------------------------------
@stampout.region
def sin_twice(x):
    return torch.sin(x) * 2


def test_same_region_three_times_traces_once():
    cap = assert_matches_eager(lambda x: sin_twice(x) + sin_twice(x) + sin_twice(x), torch.randn(4))
    assert (cap.stats.traces, cap.stats.reuses, cap.stats.subgraphs) == (1, 2, 1)


@pytest.mark.parametrize("sizes, traces", [((4, 8), 2), ((4, 8, 4), 2)])
def test_input_shapes(sizes, traces):
    def prog(*xs):
        return [sin_twice(x) for x in xs]

    cap = assert_matches_eager(prog, *[torch.randn(n) for n in sizes])
    assert cap.stats.traces == traces
    assert cap.stats.reuses == len(sizes) - traces


@stampout.region
def scaled(x, k):
    return x * k


def test_scalar_argument_each_value_traces():
    cap = assert_matches_eager(lambda x: scaled(scaled(scaled(x, 1), 2), 3), torch.randn(3))
    assert cap.stats.traces == 3


def test_scalar_type_is_part_of_the_key():
    cap = assert_matches_eager(lambda x: scaled(x, 1) + scaled(x, 1.0) + scaled(x, True), torch.randn(3))
    assert cap.stats.traces == 3


@stampout.region
def total(xs):
    return sum(x * 2 for x in xs)


def test_list_argument_length():
    cap = assert_matches_eager(lambda a, b, c: total([a, b]) + total([a, b, c]), *torch.randn(3, 4))
    assert cap.stats.traces == 2


@stampout.region
def kw_only(x, *, scale):
    return x * scale


def test_keyword_only_argument():
    cap = assert_matches_eager(lambda x: kw_only(kw_only(x, scale=2.0), scale=2.0), torch.randn(3))
    assert (cap.stats.traces, cap.stats.reuses) == (1, 1)


def test_max_reuse_entries_is_enforced():
    @stampout.region(max_reuse_entries=2)
    def capped(x, k):
        return x + k

    with pytest.raises(stampout.RegionError) as info:
        stampout.capture(lambda x: capped(x, 1) + capped(x, 2) + capped(x, 3), torch.randn(2))
    text = str(info.value)
    assert "max_reuse_entries=2" in text and "capped" in text and "k" in text


# ---- modules --------------------------------------------------------------------------------------
class Scale(nn.Module):
    def __init__(self, c=5, unused=0):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.c = c
        self.unused = unused

    @stampout.region
    def forward(self, x):
        return self.lin(x) * self.c


class Twice(nn.Module):
    def __init__(self, a, b=None):
        super().__init__()
        self.a, self.b = a, (b if b is not None else a)

    def forward(self, x):
        return self.b(self.a(x))


def test_one_module_called_twice():
    cap = assert_matches_eager(Twice(Scale()), torch.randn(2, 4), grad=True)
    assert (cap.stats.traces, cap.stats.reuses) == (1, 1)


def test_two_instances_with_equal_attributes():
    cap = assert_matches_eager(Twice(Scale(), Scale()), torch.randn(2, 4), grad=True)
    assert (cap.stats.traces, cap.stats.reuses) == (1, 1)


def test_two_instances_whose_read_attribute_differs():
    cap = assert_matches_eager(Twice(Scale(c=5), Scale(c=10)), torch.randn(2, 4), grad=True)
    assert cap.stats.traces == 2
    assert "self.c" in cap.events[1].reason


def test_unread_attribute_differs():
    cap = assert_matches_eager(Twice(Scale(unused=1), Scale(unused=2)), torch.randn(2, 4), grad=True)
    assert cap.stats.traces == 1


class Mutating(nn.Module):
    def __init__(self, attr):
        super().__init__()
        self.inner = Scale()
        self.attr = attr

    def forward(self, x):
        y = self.inner(x)
        setattr(self.inner, self.attr, 10)
        return self.inner(y)


def test_attribute_read_changed_between_calls():
    cap = assert_matches_eager(Mutating("c"), torch.randn(2, 4), grad=True)
    assert cap.stats.traces == 2


def test_attribute_not_read_changed_between_calls():
    cap = assert_matches_eager(Mutating("unused"), torch.randn(2, 4), grad=True)
    assert cap.stats.traces == 1


@dataclass
class Config:
    scale: float = 2.0
    act: str = "relu"


def test_closure_config_field_changed():
    cfg = Config()

    @stampout.region
    def block(x):
        return x * cfg.scale

    def prog(x):
        cfg.scale = 2.0
        y = block(x)
        cfg.scale = 3.0
        return block(y)

    x = torch.randn(3)
    cap = stampout.capture(prog, x)
    assert cap.stats.traces == 2
    torch.testing.assert_close(cap(x), prog(x))
    assert "closure['cfg'].scale" in cap.events[1].reason


CONFIG = Config()


@stampout.region
def global_block(x):
    return x * CONFIG.scale


def test_global_config_field_changed():
    def prog(x):
        CONFIG.scale = 2.0
        y = global_block(x)
        CONFIG.scale = 5.0
        return global_block(y)

    x = torch.randn(3)
    cap = stampout.capture(prog, x)
    assert cap.stats.traces == 2
    torch.testing.assert_close(cap(x), prog(x))


# ---- marking styles -------------------------------------------------------------------------------
class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x)) + x


class Stack(nn.Module):
    def __init__(self, n=3, layer=Plain):
        super().__init__()
        self.layers = nn.ModuleList([layer() for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _stack_counts(cap, n):
    return (cap.stats.traces, cap.stats.reuses, cap.stats.subgraphs) == (1, n - 1, 1)


def test_class_level_wrap():
    class Wrapped(Plain):
        pass

    Wrapped.forward = stampout.region(Plain.forward)
    cap = assert_matches_eager(Stack(3, Wrapped), torch.randn(2, 4), grad=True)
    assert _stack_counts(cap, 3)


def test_region_of_module_instance():
    model = Stack(3)
    for layer in model.layers:
        assert stampout.region(layer) is layer
    cap = assert_matches_eager(model, torch.randn(2, 4), grad=True)
    assert _stack_counts(cap, 3)


def test_model_apply_wraps_each_layer():
    model = Stack(4)
    model.apply(lambda m: stampout.region(m) if isinstance(m, Plain) else None)
    cap = assert_matches_eager(model, torch.randn(2, 4), grad=True)
    assert _stack_counts(cap, 4)


def test_per_instance_forward_rebound_to_new_function_with_same_code():
    def make_forward():
        def forward(self, x):
            return self.lin(torch.tanh(x)) + 1.0 + x

        return forward

    model = Stack(3)
    for layer in model.layers:
        layer.forward = types.MethodType(stampout.region(make_forward()), layer)
    cap = assert_matches_eager(model, torch.randn(2, 4), grad=True)
    assert _stack_counts(cap, 3)


def test_torch_nested_compile_region_is_a_region():
    class Marked(Plain):
        forward = torch.compiler.nested_compile_region(Plain.forward)

    cap = assert_matches_eager(Stack(3, Marked), torch.randn(2, 4), grad=True)
    assert _stack_counts(cap, 3)


def test_region_outside_capture_is_a_plain_call():
    x = torch.randn(4)
    torch.testing.assert_close(sin_twice(x), torch.sin(x) * 2)


# ---- structure --------------------------------------------------------------------------------------
class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.lin = nn.Linear(4, 4)

    @stampout.region
    def forward(self, h, residual):
        residual = h + residual
        return self.lin(self.norm(residual)), residual


class ResidualStack(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.layers = nn.ModuleList([Residual() for _ in range(n)])

    def forward(self, x):
        h, residual = x, torch.zeros_like(x)
        for layer in self.layers:
            h, residual = layer(h, residual)
        return h + residual


def test_tuple_outputs_threaded_through_stack():
    cap = assert_matches_eager(ResidualStack(3), torch.randn(2, 4), grad=True)
    assert cap.stats.traces == 1


class PassThrough(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @stampout.region
    def forward(self, x, skip):
        return self.lin(x), skip  # the second output aliases an input


class PassTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = PassThrough()

    def forward(self, x, y=None):
        return self.layer(*self.layer(x, x if y is None else y))


def test_output_aliasing_an_input():
    cap = assert_matches_eager(PassTwice(), torch.randn(2, 4), torch.randn(2, 4), grad=True)
    assert cap.stats.traces == 1


def test_the_same_tensor_twice_is_a_different_input_structure():
    cap = assert_matches_eager(PassTwice(), torch.randn(2, 4), grad=True)  # first call: (x, x)
    assert cap.stats.traces == 2
    assert "same object" in cap.events[1].reason


@pytest.mark.parametrize("n", [1, 2, 8])
def test_stack_of_identical_layers(n):
    class Layer(Plain):
        forward = stampout.region(Plain.forward)

    cap = assert_matches_eager(Stack(n, Layer), torch.randn(2, 4), grad=True)
    assert _stack_counts(cap, n)


def test_nested_regions_each_cached_under_own_code():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        @stampout.region
        def forward(self, x):
            return F.gelu(self.lin(x))

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Inner(), Inner()

        @stampout.region
        def forward(self, x):
            return self.b(self.a(x)) + x

    model = Stack(3, Outer)
    cap = assert_matches_eager(model, torch.randn(2, 4), grad=True)
    inner = [e for e in cap.events if e.region.endswith("Inner.forward")]
    outer = [e for e in cap.events if e.region.endswith("Outer.forward")]
    assert [e.outcome for e in outer] == ["traced", "reused", "reused"]
    assert [e.outcome for e in inner] == ["traced", "reused"]


def test_model_apply_wrapping_each_layers_bound_forward():
    model = Stack(4)

    def mark(module):
        if isinstance(module, Plain):
            module.forward = stampout.region(module.forward)  # a bound method: `self` is bound, not passed

    model.apply(mark)
    cap = assert_matches_eager(model, torch.randn(2, 4), grad=True)
    assert _stack_counts(cap, 4)


def test_placeholder_names_never_collide():
    class Weighted(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4))

        def forward(self, weight):  # an input with a parameter's name
            return weight * self.weight

    cap = assert_matches_eager(Weighted(), torch.randn(4), grad=True)
    names = [n.target for n in cap.gm.graph.nodes if n.op == "placeholder"]
    assert len(names) == len(set(names)) == 2


def test_functions_with_the_same_code_and_different_defaults():
    def make(k):
        @stampout.region
        def scale(x, k=k):
            return x * k

        return scale

    double, triple = make(2.0), make(3.0)
    cap = assert_matches_eager(lambda x: triple(double(x)), torch.randn(3))
    assert cap.stats.traces == 2
    assert "fn.__defaults__" in cap.events[1].reason


@stampout.region
def _first_rows(x):
    return x[:2]


@stampout.region
def _transposed_copy_and_base(x):
    h = x * 2
    return h.t().contiguous(), h  # a copy, not a view of h


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_region_output_that_views_its_input_stays_a_view(backend):
    def sees_later_write(x):
        x = x * 1
        a = _first_rows(x)
        x.add_(1)
        return a * 1

    def writes_through(x):
        a = _first_rows(x)
        a.mul_(10)
        return x * 1

    for program in (sees_later_write, writes_through):
        x, expected_x = torch.ones(4, 2), torch.ones(4, 2)
        torch.testing.assert_close(stampout.compile(program, backend=backend)(x), program(expected_x))
        torch.testing.assert_close(x, expected_x)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_copy_is_not_mistaken_for_a_view(backend):
    def f(x):
        a, b = _transposed_copy_and_base(x)
        return a + 0, b + 0

    x = torch.randn(3, 4)
    out, expected = stampout.compile(f, backend=backend)(x), f(x)
    for a, b in zip(out, expected):
        torch.testing.assert_close(a, b)


def test_in_place_on_a_stamped_output_with_grad():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        @stampout.region
        def forward(self, x):
            return self.lin(x)

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                y = layer(x)
                y += x
                x = y
            return x

    model, x = Stack(), torch.randn(4, 4)
    cap = stampout.capture(model, x)
    assert (cap.stats.traces, cap.stats.reuses) == (1, 2)
    torch.testing.assert_close(cap(x), model(x))


def test_in_place_ops_on_stamped_outputs_keep_gradients():
    """A stamped output that requires grad stands for a computed tensor (no clone made for it): in-place ops on
    it, of every kind the capture handles (`mul_`, a slice write, `add_` with a requires-grad operand), trace
    and give eager's gradients."""

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        @stampout.region
        def forward(self, x):
            return self.lin(torch.tanh(x)) + 1.0

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                y = layer(x)
                y.mul_(2.0)
                y[:, :2] = x[:, :2]
                y.add_(x)
                x = y
            return x

    cap = assert_matches_eager(Stack(), torch.randn(4, 4, requires_grad=True), grad=True)
    assert (cap.stats.traces, cap.stats.reuses) == (1, 2)
