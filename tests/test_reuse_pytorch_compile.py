"""PyTorch's invoke_subgraph tests (test_invoke_subgraph.py, TestInvokeSubgraph and the first part of
TestInvokeSubgraphCompile: outputs, gradients, mutation, aliasing, dedup) re-expressed against stampout.

What PyTorch checks through Dynamo's graphs (FX node names, schemas, partitioned backward graphs) is re-expressed
as what a user sees: values, gradients, the inputs and world after the call, and how many region bodies were
traced. Checked with `helpers.check`; `traces` counts traced + deduped bodies, as PyTorch does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import check
from torch import nn

import stampout

ncr = torch.compiler.nested_compile_region


def _grad_pair():
    return torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)


@ncr
def _mul(x, y):
    return torch.mul(x, y)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_simple(backend):
    check(lambda x, y: _mul(x, y), *_grad_pair(), traces=1, grad=True, backend=backend)


def test_multiple_regions():
    cos, sin = ncr(lambda x: torch.cos(x)), ncr(lambda x: torch.sin(x))
    check(lambda x: cos(sin(cos(x))), torch.randn(8, requires_grad=True), traces=2, reuses=1, grad=True)


def test_one_region_two_backward_variants():
    @ncr
    def block(x):
        return torch.sin(x) * 2.0

    class Model(nn.Module):
        def forward(self, x, tail):
            return torch.cat([block(block(x)), tail], dim=1).square().sum()

    check(Model(), torch.randn(4, 3, 5, requires_grad=True), torch.randn(4, 7, 5, requires_grad=True),
          traces=1, reuses=1, grad=True, backend="aot_eager")


class _Mod(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = 5

    @ncr
    def forward(self, x, y):
        return torch.mul(x, y).sin() + self.c


def test_module_forward():
    mod = _Mod()
    check(lambda x, y: mod(x, y) + mod(x, y), *_grad_pair(), traces=1, reuses=1, grad=True, backend="aot_eager")


@pytest.mark.inductor
def test_module_forward_inductor():
    mod = _Mod()
    check(lambda x, y: mod(x, y) + mod(x, y), *_grad_pair(), traces=1, reuses=1, grad=True, backend="inductor",
          calls=1, rtol=1e-4, atol=1e-5)


def test_call_sites_point_at_the_user_line():
    mod = _Mod()

    def fn(x, y):
        return mod(x, y) + mod(x, y)

    cap = stampout.capture(fn, torch.randn(8), torch.randn(8))
    line = fn.__code__.co_firstlineno + 1
    assert [e.call_site.rsplit(":", 1)[-1].split()[0] for e in cap.events] == [str(line)] * 2, cap.events
    nodes = [n for n in cap.gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(nodes) == 2 and len({n.args[0].target for n in nodes}) == 1


class _BufMod(nn.Module):
    def __init__(self, mutate):
        super().__init__()
        self.c, self.mutate = 5, mutate
        self.register_buffer("buf", torch.ones(8))

    @ncr
    def forward(self, x, y):
        if self.mutate:
            self.buf.add_(1)
        return torch.mul(x, y).sin() * self.c + self.buf


def _buf_case(mutate):
    mod = _BufMod(mutate)
    return mod, dict(reset=lambda: mod.buf.fill_(1.0), world=lambda: mod.buf.clone())


def test_buffer_mutation_in_a_region():
    mod, kw = _buf_case(True)
    with torch.no_grad():
        check(lambda m, x, y: m(x, y) + m(x, y), mod, torch.randn(8), torch.randn(8), **kw)


def test_buffer_read_in_a_region_with_gradients():
    mod, kw = _buf_case(False)
    check(lambda m, x, y: m(x, y) + m(x, y), mod, *_grad_pair(), traces=1, reuses=1, grad=True,
          backend="aot_eager", **kw)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "no_requires_grad"])
def test_buffer_mutation_without_gradients(mode):
    mod, kw = _buf_case(True)
    x, y = (torch.randn(8, requires_grad=mode != "no_requires_grad") for _ in range(2))
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode)

    def fn(m, x, y):
        if ctx is None:
            return m(x, y) + m(x, y)
        with ctx():
            return m(x, y) + m(x, y)

    check(fn, mod, x, y, backend="aot_eager", **kw)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_buffer_mutation_in_training_is_right_or_refused(backend):
    mod, kw = _buf_case(True)
    try:
        check(lambda m, x, y: m(x, y) + m(x, y), mod, *_grad_pair(), grad=True, backend=backend, **kw)
    except stampout.StampoutError as error:
        assert "buf" in str(error)


def test_list_output():
    gn = ncr(lambda x, y: [torch.mul(x, y), torch.add(x, y)])

    def fn(x, y):
        lst = gn(x, y)
        lst.append(torch.sin(x))
        return lst[0] + lst[1] + lst[2]

    check(fn, *_grad_pair(), traces=1, grad=True)


def test_tuple_of_tuple_output():
    gn = ncr(lambda x, y: ((torch.mul(x, y),), torch.add(x, y)))

    def fn(x, y):
        tup = gn(x, y)
        return tup[0][0] + tup[1]

    check(fn, *_grad_pair(), traces=1, grad=True)


def test_autograd_function_backward_needing_contiguous_grad():
    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.sin(x)

        @staticmethod
        def backward(ctx, grad_out):
            return torch.cos(torch.reshape(grad_out.reshape(12, 5), (3, 4, 5)))

    gn = ncr(lambda x: Op.apply(x))
    check(lambda x: torch.permute(gn(x), (0, 2, 1)), torch.randn(3, 4, 5, requires_grad=True), grad=True,
          backend="aot_eager")


def test_sdpa_causal():
    gn = ncr(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True))
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    check(lambda q, k, v: gn(q, k, v) + gn(v, k, q), q, k, v, traces=1, reuses=1, grad=True, rtol=1e-4,
          atol=1e-5)


def test_symbolic_sizes_from_forward_to_backward():
    @ncr
    def gn(x, y):
        return torch.matmul(torch.sum(x, (1,), keepdim=True).view(y.shape[1], y.shape[0]), y)

    compiled = stampout.compile(lambda x, y: gn(x, y), backend="aot_eager")
    for n in (8, 16, 4):
        x, y = torch.randn(n * n, 1, requires_grad=True), torch.randn(n, n, requires_grad=True)
        xe, ye = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
        out, ref = compiled(x, y), gn(xe, ye)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        out.sum().backward()
        ref.sum().backward()
        torch.testing.assert_close(x.grad, xe.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(y.grad, ye.grad, rtol=1e-4, atol=1e-5)


def test_dropout_in_a_region_draws_as_eager():
    gn = ncr(lambda x: F.dropout(torch.sin(x), p=0.5))
    hn = ncr(lambda x: torch.sin(x))
    check(lambda x: gn(x) + hn(x), torch.randn(8, requires_grad=True), grad=True,
          reset=lambda: torch.manual_seed(0), world=lambda: torch.random.get_rng_state())


def test_dropout_in_a_region_without_gradients():
    gn = ncr(lambda x: F.dropout(torch.sin(x), p=0.5))
    check(lambda x: gn(x), torch.randn(8), reset=lambda: torch.manual_seed(0),
          world=lambda: torch.random.get_rng_state())


def test_dedupe_chained_calls():
    check(lambda x, y: _mul(_mul(x, y), y), *_grad_pair(), traces=1, reuses=1, grad=True)


def test_functional_call_with_a_closure_parameter_dict():
    mod = nn.Linear(10, 10)
    params = {**dict(mod.named_parameters()), **dict(mod.named_buffers())}
    gn = ncr(lambda x: torch.func.functional_call(mod, params, (x,)))
    check(lambda x: gn(x) + gn(x), torch.randn(10, 10), traces=1, reuses=1, modules=[mod])


def test_functional_call_of_a_module_that_writes_a_closure_cell():
    foo = [0]

    class Mod(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(10, 10)

        def forward(self, x):
            foo[0] += 1
            return self.linear(x)

    mod = Mod()
    params = dict(mod.named_parameters())
    gn = ncr(lambda x: torch.func.functional_call(mod, params, (x,)))
    check(lambda x: gn(x) + gn(x), torch.randn(10, 10), reset=lambda: foo.__setitem__(0, 0),
          world=lambda: foo[0])


def test_unused_intermediate():
    @ncr
    def gn(x):
        x = torch.sin(x)
        torch.cos(x)
        return x

    check(lambda x: gn(x), torch.randn(4), traces=1)


def test_checkpoint_inside_a_region_then_detach():
    def body(x):
        torch.cos(x)
        return torch.sin(x)

    gn = ncr(lambda x: torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False))
    check(lambda x: gn(x).detach(), torch.randn(8, requires_grad=True))


def test_nonlocal_read_changed_between_calls():
    counter = 2

    @ncr
    def gn(x, y):
        return (torch.mul(x, y) * counter,)

    def fn(x, y):
        nonlocal counter
        counter = 2
        a = gn(x, y)[0]
        counter = 3
        return gn(a, y)[0]

    check(fn, *_grad_pair(), traces=2, grad=True, world=lambda: counter)


def test_region_appends_to_a_list_argument():
    @ncr
    def gn(x, z):
        o = torch.matmul(x, x) @ x
        z.append(x.sin())
        return torch.cos(torch.sin(o)), torch.sin(x)

    def fn(x):
        z = []
        outs = gn(x, z)
        return outs[0] + outs[-1], z[0]

    check(fn, torch.randn(4, 4, requires_grad=True), grad=True, rtol=1e-4, atol=1e-5)


def test_view_inside_a_region():
    gn = ncr(lambda x: torch.sin(torch.sin(x).view(1, 8)))
    check(lambda x: gn(x), torch.randn(8), traces=1)


def test_loop_of_region_calls_traces_once():
    @ncr
    def gn(x, y):
        for _ in range(5):
            x = x * y
        return x

    def fn(x, y):
        for _ in range(5):
            x = gn(x, y)
        return x

    check(fn, *_grad_pair(), traces=1, reuses=4, grad=True, rtol=1e-4, atol=1e-5)


@ncr
def _add_one_then_mul(x, y):
    x.add_(1)
    return torch.mul(x, y)


def test_input_mutation():
    check(lambda x, y: _add_one_then_mul(x, y), torch.randn(8), torch.randn(8), traces=1)


def test_input_mutation_many_times():
    def fn(x, y):
        z = _add_one_then_mul(x, y)
        for _ in range(16):
            z += _add_one_then_mul(x, y)
        return z

    with torch.no_grad():
        check(fn, torch.randn(8), torch.randn(8), traces=1, reuses=16)


def test_input_mutation_under_inference_mode():
    def fn(x, y):
        z = torch.cos(x)
        with torch.inference_mode():
            return _add_one_then_mul(torch.cos(z), y)

    check(fn, torch.randn(8), torch.randn(8))


@pytest.fixture
def scale_into():
    with torch.library._scoped_library("stampout_reuse", "FRAGMENT") as lib:
        lib.define("scale_into(Tensor x, Tensor! out, float scale) -> ()")
        def impl(x, out, scale):
            out.copy_(x * scale)

        lib.impl("scale_into", impl, "CompositeExplicitAutograd")
        yield torch.ops.stampout_reuse.scale_into


def test_input_mutation_through_an_alias_annotated_custom_op(scale_into):
    @ncr
    def gn(x, y):
        out = torch.empty_like(y)
        scale_into(y, out, 2.0)
        x.add_(out)
        return torch.mul(x, y)

    check(lambda x, y: gn(x, y), torch.randn(8), torch.randn(8), traces=1)


def test_input_mutation_through_a_custom_op_with_aot_eager(scale_into):
    @ncr
    def gn(x, y):
        out = torch.empty_like(y)
        scale_into(y, out, 2.0)
        x.add_(out)
        return torch.mul(x, y)

    check(lambda x, y: gn(x, y), torch.randn(8), torch.randn(8), traces=1, backend="aot_eager")


def test_several_inputs_mutated_through_a_custom_op(scale_into):
    @ncr
    def gn(x, y, z):
        out = torch.empty_like(y)
        scale_into(y, out, 2.0)
        x.add_(out)
        z.sub_(y)
        return torch.mul(x, z)

    for backend in ("eager", "aot_eager"):  # (aot_eager: the calls are inlined, see backends/inline.py)
        check(lambda x, y, z: gn(x, y, z), torch.randn(8), torch.randn(8), torch.randn(8), traces=1, backend=backend)


def test_print_op_in_a_region_runs_every_call(capfd):
    @ncr
    def gn(x, y):
        torch.ops.aten._print.default("effect")
        x.add_(y)
        return x * y

    fn = lambda x, y: gn(x, y)  # noqa: E731
    compiled = stampout.compile(fn, backend="aot_eager")
    for _ in range(2):
        x, y = torch.randn(8), torch.randn(8)
        xe = x.clone()
        capfd.readouterr()
        expected = fn(xe, y)
        eager_out = capfd.readouterr().out
        torch.testing.assert_close(compiled(x, y), expected)
        torch.testing.assert_close(x, xe)
        assert capfd.readouterr().out == eager_out == "effect\n"


def test_region_mutates_a_view_of_the_input_twice():
    @ncr
    def gn(x):
        x.add_(2)
        return x.sin()

    check(lambda base: gn(base[1:5]) + gn(base[1:5]), torch.randn(8), traces=1, reuses=1)


def test_closure_module_with_inputs_not_requiring_grad():
    mod = nn.Linear(8, 8)
    gn = ncr(lambda x: (torch.cos(x), mod(x)))

    def fn(x):
        out = gn(x)
        return out[0] + out[1]

    check(fn, torch.randn(8, 8), grad=True, modules=[mod], traces=1)


@pytest.mark.parametrize("case", ["input-output", "input-input", "output-output"])
def test_aliasing_across_the_region_boundary(case):
    if case == "input-output":
        gn = ncr(lambda x, y: (x, torch.mul(x, y)))
        check(lambda x, y: gn(x, y)[0] * gn(x, y)[1], torch.randn(8), torch.randn(8), traces=1, reuses=1)
    elif case == "input-input":
        check(lambda x: _mul(x, x.view(1, 8)), torch.randn(8), traces=1)
    else:
        @ncr
        def gn(x):
            z = torch.cos(x)
            return z, z.view(1, 8)

        check(lambda x: gn(x), torch.randn(8), traces=1)


_VIEWS: list = []


@ncr
def _keeps_a_view(x):
    view = torch.sin(x).view(1, 8)
    _VIEWS.append(view)
    return torch.sin(view)


def test_region_keeps_an_aliased_intermediate_in_a_global_list():
    def fn(x):
        result = _keeps_a_view(x)
        return result + _VIEWS[0] if _VIEWS else result

    check(fn, torch.randn(8), reset=_VIEWS.clear, world=lambda: list(_VIEWS))


def test_plain_tensor_attribute_mutated_in_a_region():
    class MutateAttr(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.ones(8)

        def forward(self, x):
            self.a.add_(1)
            return torch.mul(x, self.a)

    mod = MutateAttr()
    gn = ncr(lambda x: mod(x))
    check(lambda x, y: gn(x) * y, torch.randn(8), torch.randn(8), reset=lambda: mod.a.fill_(1.0),
          world=lambda: mod.a.clone())


def test_redundant_region_marking():
    gn = ncr(ncr(lambda x: torch.sin(x)))
    check(lambda x: gn(x) + gn(x), torch.randn(8, 8, requires_grad=True), traces=1, reuses=1, grad=True)


def test_inference_mode_block_is_kept_in_the_graph():
    def fn(x):
        with torch.inference_mode():
            a = _mul(x, x) * 2
        return a, _mul(x, x)

    cap = check(fn, torch.randn(8, requires_grad=True), backend="aot_eager")
    assert [t.requires_grad for t in cap(torch.randn(8, requires_grad=True))] == [False, True]
