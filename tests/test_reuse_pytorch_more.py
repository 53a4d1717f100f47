"""PyTorch's invoke_subgraph tests (test_invoke_subgraph.py: the rest of TestInvokeSubgraphCompile, and
TestInvokeSubgraphExport, NegativeTesting, TestInline*InvokeSubgraph, TestInvokeSubgraphTrainStepCapture)
re-expressed against stampout as values, gradients, the world after the call and trace counts (`helpers.check`).

Not re-expressed (meaningless for stampout): make_fx without a ShapeEnv, the boxed-codegen epilogue wrapper,
calling the invoke_subgraph HOP directly, Triton kernels and Inductor pattern-matcher passes (GPU only),
and regional-compile options on backward nodes (an Inductor config of Dynamo's train-step capture).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from helpers import check
from torch import nn

import stampout

ncr = torch.compiler.nested_compile_region

_sin = ncr(lambda x: torch.sin(x))
_cos = ncr(lambda x: torch.cos(x))


def test_kwargs_only():
    gn = ncr(lambda x, *, y: x * y)
    check(lambda x, y: gn(x, y=y), torch.randn(8), torch.randn(8), traces=1)


def test_module_method_region():
    class Mod(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        @ncr
        def helper(self, x):
            return self.linear(x)

        def forward(self, x):
            return x + self.helper(x) * self.helper(x) + x

    check(Mod(), torch.randn(8, 8, requires_grad=True), traces=1, reuses=1, grad=True)


def test_submodule_instance_region():
    class Mod(nn.Module):
        def __init__(self):
            super().__init__()
            self.submod = ncr(nn.Tanh())

        def forward(self, x):
            return x + self.submod(x) * self.submod(x) + x

    check(Mod(), torch.randn(8, 8, requires_grad=True), traces=1, reuses=1, grad=True)


def test_dropout_not_training_with_a_closure_weight():
    weight = torch.ones(64, requires_grad=True)
    gn = ncr(lambda x, train: F.dropout(x * weight, 0.33, train))

    def fn(x):
        return gn(x, False)

    check(fn, torch.ones(64), grad=True, traces=1, world=lambda: weight.grad)


def test_none_among_the_outputs():
    gn = ncr(lambda x: (x * 2, None, x * 3))

    def fn(x):
        ys = gn(x)
        return ys[0] + ys[2]

    check(fn, torch.randn(8, 8, requires_grad=True), traces=1, grad=True)


def test_marked_dynamic_input():
    x = torch.randn(8, 8, requires_grad=True)
    torch._dynamo.mark_dynamic(x, 0)
    check(lambda x: _sin(x) + _sin(x), x, traces=1, reuses=1, grad=True)


def test_gradients_accumulate_into_closure_modules():
    mod1, mod2, mod3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
    gn = ncr(lambda x: mod1(x) - mod2(x))
    check(lambda c: (gn(c) - mod3(c)) * 2, torch.randn(8, 8, requires_grad=True), grad=True,
          modules=[mod1, mod2, mod3], traces=1)


def test_complex_input():
    check(lambda x: _sin(x) + _sin(x), torch.randn(2, 2, dtype=torch.complex64), traces=1, reuses=1)


def _first_item(x):
    return x * x[0].item()


def _prefix(x, y):
    return y[: x.item()].clone()


def _checked_prefix(x, y):
    b = x.item()
    torch._check(b >= 0)
    torch._check(b < y.shape[0])
    return y[:b].clone()


@pytest.mark.parametrize("body, args", [(_first_item, (torch.randn(8),)),
                                        (_prefix, (torch.tensor(4), torch.randn(8))),
                                        (_checked_prefix, (torch.tensor(4), torch.randn(8))),
                                        (lambda x: torch.sin(torch.nonzero(x)), (torch.randn(64, 1),))],
                         ids=["pending-item", "item-slice", "checked-item-slice", "nonzero"])
def test_data_dependent_region_refused_by_capture_run_eagerly_by_compile(body, args, caplog):
    gn = ncr(body)

    def fn(*a):
        return gn(*a)

    with pytest.raises(stampout.StampoutError, match="test_reuse_pytorch_more.py"):
        stampout.capture(fn, *args)
    with caplog.at_level(logging.WARNING, logger="stampout"):
        check(fn, *args, capture=False)
    assert "eagerly" in caplog.text


def test_matmul_then_sin_backward():
    gn = ncr(lambda x, y: torch.sin(torch.matmul(x, y)))
    check(lambda x, y: torch.sin(gn(x, y)), torch.randn(8, 8, requires_grad=True),
          torch.randn(8, 8, requires_grad=True), traces=1, grad=True, rtol=1e-4, atol=1e-5)


def test_tensor_constant_made_in_a_region():
    gn = ncr(lambda x: torch.tensor(64, dtype=torch.float32) * x)
    check(lambda x: gn(x) + gn(x), torch.randn(64, requires_grad=True), traces=1, reuses=1, grad=True,
          backend="aot_eager")


def _checkpointed(body):
    return ncr(lambda x: torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False))


def test_activation_checkpoint_regions():
    c1, c2 = _checkpointed(torch.cos), _checkpointed(torch.sin)
    cap = check(lambda x: c1(x) + c1(x) + c2(x), torch.randn(8, requires_grad=True), grad=True, backend="aot_eager")
    assert cap.stats.subgraphs == 2  # (the second c1 call is traced, then deduped)


def test_activation_checkpoint_with_dropout_draws_as_eager():
    c1 = _checkpointed(lambda x: torch.cos(F.dropout(x, p=0.5)))
    check(lambda x: c1(x) + c1(x), torch.randn(8, requires_grad=True), grad=True,
          reset=lambda: torch.manual_seed(0), world=lambda: torch.random.get_rng_state())


def test_different_shapes_get_different_bodies():
    check(lambda x, y: (_sin(x), _sin(y)), torch.randn(8, 8, requires_grad=True),
          torch.randn(16, 16, requires_grad=True), traces=2, grad=True)


@pytest.mark.parametrize("dynamic", [True, False])
def test_region_returns_its_input_shape(dynamic):
    gn = ncr(lambda x: (x + 1, x.shape))

    def fn(x):
        z0, z1 = gn(x), gn(x)
        return z0[0] + z1[0], z0[1]

    check(fn, torch.randn(8, 8, requires_grad=True), grad=True, dynamic=dynamic)


def test_symbolic_sizes_differ_between_calls():
    def fn(x):
        a = _sin(x)
        return _sin(torch.narrow(a, 0, 0, a.size()[0] // 2))

    x = torch.randn(8, 8, requires_grad=True)
    torch._dynamo.mark_dynamic(x, 0)
    check(fn, x, traces=2, grad=True)


def test_autograd_function_in_a_region():
    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return torch.sin(x)

        @staticmethod
        def backward(ctx, grad_out):
            (x,) = ctx.saved_tensors
            return x * torch.cos(grad_out)

    gn = ncr(lambda x: Op.apply(x))
    check(lambda x: gn(x) + gn(x), torch.randn(8, 8, requires_grad=True), traces=1, reuses=1, grad=True)


def test_different_strides_in_backward():
    def fn(x):
        c = _cos(torch.sin(_cos(_cos(x))))
        return c.sum() + _cos(c).sum()

    x = torch.randn(8, 16, requires_grad=True)
    torch._dynamo.mark_dynamic(x, 0)
    check(fn, x, traces=1, reuses=3, grad=True, backend="aot_eager", rtol=1e-4, atol=1e-5)


def test_python_int_arithmetic_in_a_region():
    @ncr
    def gn(x):
        div = torch.div(1024, 256, rounding_mode="trunc")
        return div * torch.ones(64, div) * x

    check(lambda x: gn(x), torch.randn(64, 1, requires_grad=True), grad=True)


class _Foo:
    def __init__(self, a, b):
        self.a, self.b = a, b


def test_region_returns_a_user_object():
    gn = ncr(lambda x, y: _Foo(torch.sin(x), torch.cos(y)))

    def fn(x, y):
        foo1 = gn(x, y)
        return foo1.b + gn(foo1.a, y).a

    check(fn, torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True), grad=True)


def test_two_outputs_used_twice_backward():
    gn = ncr(lambda x: (torch.sin(x), torch.cos(x)))

    def fn(x):
        foo1 = gn(x)
        foo2 = gn(foo1[0])
        return foo1[1] + foo2[0] + foo2[1]

    check(fn, torch.randn(8, 8, requires_grad=True), traces=1, reuses=1, grad=True)


_max0 = ncr(lambda x: torch.max(x, 0))


@ncr
def _max_pair(x):
    a, b = _max0(x)
    return a, b


@pytest.mark.parametrize("used", ["all", "some"])
def test_nested_regions_with_unused_outputs(used):
    def fn(x):
        _, b = _max0(x)
        c, d = _max_pair(x)
        return (b, c, d) if used == "all" else (b, d)

    check(fn, torch.randn(64, 1))


def test_autograd_grad_inside_the_program():
    gn = ncr(lambda x, w: torch.matmul(x, w))

    def fn(x, w):
        loss = (gn(x, w) + gn(x, w)).sum()
        (grad_w,) = torch.autograd.grad(loss, w)
        return loss.detach(), grad_w

    check(fn, torch.randn(4, 4), torch.randn(4, 4, requires_grad=True), capture=False)


def test_autograd_grad_through_checkpointed_regions():
    gn = ncr(lambda x: torch.matmul(x, x))

    def fn(x):
        def body(x):
            return torch.relu(gn(torch.sin(x)))

        out1 = torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False)
        out2 = torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False)
        loss = (out1 + out2).sum()
        (grad,) = torch.autograd.grad(loss, x)
        return loss.detach(), grad

    check(fn, torch.randn(4, 4, requires_grad=True), capture=False)


def test_graph_break_call_in_a_region():
    @ncr
    def gn(x):
        torch._dynamo.graph_break()
        return torch.cos(x)

    check(lambda x: gn(x), torch.randn(8, 8, requires_grad=True), grad=True)


@pytest.mark.parametrize("case", ["single", "multi", "mixed"])
def test_single_and_multi_use_regions(case):
    fns = {"single": (lambda x: _sin(x), 1, 0), "multi": (lambda x: _sin(x) + _sin(x), 1, 1),
           "mixed": (lambda x: _cos(_sin(x) + _sin(x)), 2, 1)}
    fn, traces, reuses = fns[case]
    check(fn, torch.randn(8, requires_grad=True), traces=traces, reuses=reuses, grad=True)


def test_checkpoint_of_a_region_twice():
    def fn(x):
        return (torch.utils.checkpoint.checkpoint(_sin, x, use_reentrant=False)
                + torch.utils.checkpoint.checkpoint(_sin, x, use_reentrant=False))

    check(fn, torch.randn(8, requires_grad=True), grad=True)


def test_backward_inside_the_forward():
    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_non_differentiable(aux := x.max())
            ctx.save_for_backward(x)
            return x.sin(), aux

        @staticmethod
        def backward(ctx, grad_out, grad_aux):
            (x,) = ctx.saved_tensors
            return grad_out * x.cos()

    gn = ncr(lambda x: Op.apply(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.head = nn.Linear(4, 4, bias=False), nn.Linear(4, 1, bias=False)

        def forward(self, x):
            z, aux = gn(self.linear(x))
            z_det = z.detach().requires_grad_()
            loss = self.head(z_det).sum()
            loss.backward()
            z.backward(z_det.grad)
            return loss.detach(), aux

    model = Model()

    def grads():
        return [p.grad.clone() for p in model.parameters()]

    def reset():
        for p in model.parameters():
            p.grad = None

    check(model, torch.randn(4, 4), capture=False, reset=reset, world=grads)


# ---- export -------------------------------------------------------------------------------------


def _exported(module, *args, dynamic_shapes=None, **kwargs):
    ep = stampout.export(module, *args, dynamic_shapes=dynamic_shapes, **kwargs)
    torch.testing.assert_close(ep.module()(*args, **kwargs), module(*args, **kwargs))
    return [n for n in ep.graph_module.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]


class _Twice(nn.Module):
    def forward(self, x, y):
        return _mul(_mul(x, y), y)


_mul = ncr(lambda x, y: torch.mul(x, y))


def test_export_function_region():
    nodes = _exported(_Twice(), torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True))
    assert len(nodes) == 2 and len({n.args[0].target for n in nodes}) == 1


def test_export_method_region():
    class M(nn.Module):
        @ncr
        def gn(self, x, y):
            return torch.mul(x, y)

        def forward(self, x, y):
            return self.gn(self.gn(x, y), y)

    nodes = _exported(M(), torch.randn(8), torch.randn(8))
    assert len(nodes) == 2 and len({n.args[0].target for n in nodes}) == 1


def test_export_ten_modules_with_buffers():
    b = torch.randn(8)

    class N(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("buf", b)

        @ncr
        def forward(self, x, y):
            return x * y + self.buf

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.mod_list = nn.ModuleList(N() for _ in range(10))

        def forward(self, x, y):
            for m in self.mod_list:
                x = m(x, y)
            return x

    nodes = _exported(M(), torch.randn(8), torch.randn(8))
    assert len(nodes) == 10 and len({n.args[0].target for n in nodes}) == 1


def test_export_region_with_a_tensor_constant():
    block = ncr(lambda x: x * torch.tensor([1.0, 2.0, 3.0, 4.0]) + 1.0)

    class M(nn.Module):
        def forward(self, x):
            return block(block(x))

    _exported(M(), torch.randn(4))


def test_export_region_keyword_argument():
    gn = ncr(lambda x, y, *, scale=1.0: x * y * scale)

    class M(nn.Module):
        def forward(self, x, y):
            return gn(x, y, scale=2.0)

    _exported(M(), torch.randn(4), torch.randn(4))


@pytest.mark.parametrize("body", [_checked_prefix, _first_item], ids=["item-slice", "pending-item"])
def test_export_data_dependent_region_is_refused_by_name(body):
    gn = ncr(body)

    class M(nn.Module):
        def forward(self, *a):
            return torch.cat([gn(*a) for _ in range(4)])

    args = (torch.tensor(4), torch.randn(8)) if body is _checked_prefix else (torch.randn(8),)
    with pytest.raises(stampout.StampoutError, match="test_reuse_pytorch_more.py"):
        stampout.export(M(), *args)
