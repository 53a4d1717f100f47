"""Soundness regressions: programs an ordinary PyTorch user writes, on which stampout must either equal eager
(values, and gradients where trainable) or, only where a Python side effect cannot be replayed, raise a
`stampout.StampoutError`. Each case names what makes a cached trace (or a compiled entry) stale."""

from __future__ import annotations

import copy
import functools
import os
import random
import types
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import scalar_loss, tree_assert_close, tree_clone, tree_leaves
from torch import nn
from torch.nn.utils import parametrize

import stampout

TOL = {"rtol": 1e-4, "atol": 1e-5}
D = 4

# ------------------------------------------------------------------------------------------------ helpers


def _params(model: Any) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters()) if isinstance(model, nn.Module) else []


def _run_with_grads(fn: Callable[..., Any], args: tuple, params: list[tuple[str, torch.Tensor]],
                    grad: bool) -> tuple[Any, dict[str, torch.Tensor | None], list[torch.Tensor | None]]:
    """Run `fn` on a clone of `args`; with `grad`, backpropagate `scalar_loss` and collect the gradients of
    `params` and of the leaf inputs that require grad."""
    for _, p in params:
        p.grad = None
    args = tree_clone(args)
    out = fn(*args)
    if not grad:
        return out, {}, []
    scalar_loss(out).backward()
    pgrads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in params}
    igrads = [t.grad for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad]
    for _, p in params:
        p.grad = None
    return out, pgrads, igrads


def _assert_same(actual: tuple, expected: tuple, what: str) -> None:
    out_a, pg_a, ig_a = actual
    out_e, pg_e, ig_e = expected
    tree_assert_close(out_a, out_e, f"{what}: out", **TOL)
    assert list(pg_a) == list(pg_e)
    for name in pg_e:
        e, a = pg_e[name], pg_a[name]
        assert (e is None) == (a is None), f"{what}: grad of {name}: eager {e is not None}, got {a is not None}"
        if e is not None:
            torch.testing.assert_close(a, e, msg=lambda m, n=name: f"{what}: grad of {n}: {m}", **TOL)
    for i, (a, e) in enumerate(zip(ig_a, ig_e)):
        assert (e is None) == (a is None), f"{what}: grad of input {i}"
        if e is not None:
            torch.testing.assert_close(a, e, msg=lambda m, i=i: f"{what}: grad of input {i}: {m}", **TOL)


def check_capture(fn: Callable[..., Any], *args: Any, grad: bool = True, params_of: Any = None) -> stampout.Capture:
    """Eager on `fn` itself (no copy: per-instance patches and closures stay as they are), then capture and run
    the capture on the same live state; outputs and gradients must match."""
    params = _params(params_of if params_of is not None else fn)
    expected = _run_with_grads(fn, args, params, grad)
    cap = stampout.capture(fn, *tree_clone(args))
    cap.gm.graph.lint()
    actual = _run_with_grads(cap, args, params, grad)
    _assert_same(actual, expected, "capture")
    return cap


def check_call(eager: Callable[..., Any], compiled: Callable[..., Any], *args: Any, grad: bool = True,
               params_of: Any = None, what: str = "call") -> None:
    """One compiled call against eager on the same (current) state."""
    params = _params(params_of if params_of is not None else eager)
    expected = _run_with_grads(eager, args, params, grad)
    actual = _run_with_grads(compiled, args, params, grad)
    _assert_same(actual, expected, what)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Block(nn.Module):
    """A residual block whose forward is the region."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp()

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mlp(x))


def _stack(cls: type[nn.Module], n: int, *a: Any) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[cls(*a) for _ in range(n)])


def _x(*shape: int, grad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(*(shape or (2, D)), generator=g).requires_grad_(grad)


# ---------------------------------------------------------------------------- 1-6: capture reuses wrongly


@pytest.mark.parametrize("kind", ["lambda", "bound"])
def test_case01_per_instance_forward_on_submodule_is_guarded(kind: str) -> None:
    """`layers[3].mlp.forward = ...` (a lambda or a bound method with other code) must not be stamped out
    from layer 0's trace."""
    model = _stack(Block, 5)
    mlp = model[3].mlp
    if kind == "lambda":
        mlp.forward = lambda x: mlp.fc(x) * 3.0
    else:
        def doubled(self: Mlp, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.fc(x)) - 1.0

        mlp.forward = types.MethodType(doubled, mlp)
    cap = check_capture(model, _x())
    assert cap.stats.traces >= 2


def test_case02_class_default_overridden_on_one_instance() -> None:
    """A class-level `use_gate = False` overridden on one instance changes that layer's branch."""

    class Gated(nn.Module):
        use_gate = False

        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(D, D)

        @stampout.region
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            if self.use_gate:
                h = h * torch.sigmoid(h)
            return h

    model = _stack(Gated, 4)
    model[2].use_gate = True
    cap = check_capture(model, _x())
    assert cap.stats.traces >= 2
    # the reverse: the first layer overrides, the others read the class default
    model = _stack(Gated, 4)
    model[0].use_gate = True
    cap = check_capture(model, _x())
    assert cap.stats.traces >= 2


def test_case03_functools_partial_activation_per_layer() -> None:
    """`self.act = functools.partial(F.leaky_relu, negative_slope=a)` differing per layer."""

    class Act(nn.Module):
        def __init__(self, slope: float) -> None:
            super().__init__()
            self.fc = nn.Linear(D, D)
            self.act = functools.partial(F.leaky_relu, negative_slope=slope)

        @stampout.region
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.fc(x))

    torch.manual_seed(0)
    model = nn.Sequential(Act(0.01), Act(0.5), Act(0.01), Act(2.0))
    cap = check_capture(model, -_x().abs())
    assert cap.stats.traces == 3


def test_case04_decision_on_constant_tensor_value() -> None:
    """`if bool((mask == 0).all()): return x` on masks built from torch.zeros / torch.ones."""

    @stampout.region
    def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if bool((mask == 0).all()):
            return x
        return x * mask + 1.0

    def prog(x: torch.Tensor) -> torch.Tensor:
        h = masked(x, torch.zeros(2, D))
        h = masked(h, torch.ones(2, D))
        return masked(h, torch.zeros(2, D))

    cap = check_capture(prog, _x(grad=True))
    assert cap.stats.traces == 2

    def reverse(x: torch.Tensor) -> torch.Tensor:
        return masked(masked(x, torch.ones(2, D)), torch.zeros(2, D))

    check_capture(reverse, _x(grad=True))


class Tied(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.a = nn.Linear(D, D, bias=False)
        self.b = nn.Linear(D, D, bias=False)
        if tie:
            self.b.weight = self.a.weight

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("order", [(True, False), (False, True), (True, False, True, False)])
def test_case05_tied_and_untied_weights(order: tuple[bool, ...]) -> None:
    """A layer whose two linears share one weight and a layer whose do not (equal shapes)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Tied(t) for t in order])
    check_capture(model, _x(grad=True))


def test_case05_tying_weights_between_compiled_calls() -> None:
    """Tying (then untying) a layer's weights between compiled calls."""
    torch.manual_seed(0)
    model = nn.Sequential(Tied(False), Tied(False))
    fn = stampout.compile(model, backend="eager")
    check_call(model, fn, _x(grad=True), what="untied")
    model[1].b.weight = model[1].a.weight
    check_call(model, fn, _x(grad=True), what="layer 1 tied")
    model[1].b.weight = nn.Parameter(torch.randn(D, D))
    check_call(model, fn, _x(grad=True), what="layer 1 untied again")


@dataclass(slots=True)
class SlotCfg:
    scale: float = 1.0
    shift: bool = False


SLOT_CFG = SlotCfg()


@stampout.region
def _scaled_by_global_slots(x: torch.Tensor) -> torch.Tensor:
    h = x * SLOT_CFG.scale
    if SLOT_CFG.shift:
        h = h + 1.0
    return h


def test_case06_slots_dataclass_mutated_between_region_calls() -> None:
    """A `@dataclass(slots=True)` config (global, then closure) changed between two calls in one program."""

    def prog(x: torch.Tensor) -> torch.Tensor:
        SLOT_CFG.scale, SLOT_CFG.shift = 1.0, False
        h = _scaled_by_global_slots(x)
        SLOT_CFG.scale = 3.0
        h = _scaled_by_global_slots(h)
        SLOT_CFG.shift = True
        h = _scaled_by_global_slots(h)
        SLOT_CFG.scale, SLOT_CFG.shift = 1.0, False
        return h

    cap = check_capture(prog, _x(grad=True))
    assert cap.stats.traces == 3

    cfg = SlotCfg()

    @stampout.region
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * cfg.scale + (1.0 if cfg.shift else 0.0)

    def closure_prog(x: torch.Tensor) -> torch.Tensor:
        cfg.scale, cfg.shift = 1.0, False
        h = scaled(x)
        cfg.scale = 5.0
        h = scaled(h)
        cfg.shift = True
        return scaled(h)

    cap = check_capture(closure_prog, _x(grad=True))
    assert cap.stats.traces == 3


# ------------------------------------------------------------------------- 7-13: compile runs stale state


@dataclass
class Batch:
    x: torch.Tensor
    bias: torch.Tensor


def test_case07_tensor_in_dataclass_argument() -> None:
    """A new dataclass argument with a new tensor of the same metadata on a later call."""
    model = _stack(Block, 2)

    def prog(b: Batch) -> torch.Tensor:
        return model(b.x) + b.bias

    fn = stampout.compile(prog, backend="eager")
    x = _x()
    for value in (1.0, 2.0, -3.0):
        b = Batch(x, torch.full((D,), value))
        check_call(prog, fn, b, params_of=model, what=f"bias={value}")


TABLE = torch.full((D,), 1.0)


def _use_table(x: torch.Tensor) -> torch.Tensor:
    return x * TABLE


def test_case08_global_tensor_rebound() -> None:
    """A global tensor rebound to another of the same metadata (`TABLE = torch.full(...)`)."""
    global TABLE
    saved = TABLE
    fn = stampout.compile(_use_table, backend="eager")
    try:
        for value in (1.0, 2.0, 7.0):
            TABLE = torch.full((D,), value)
            check_call(_use_table, fn, _x(), grad=False, what=f"TABLE={value}")
    finally:
        TABLE = saved


def test_case09_parameter_replaced_through_parameters_dict() -> None:
    """`module._parameters["weight"] = new_param` between compiled calls."""
    model = _stack(Block, 2)
    fn = stampout.compile(model, backend="eager")
    x = _x()
    check_call(model, fn, x, what="first")
    lin = model[1].mlp.fc
    lin._parameters["weight"] = nn.Parameter(torch.full((D, D), 0.5))
    check_call(model, fn, x, what="after _parameters swap")
    lin._parameters["bias"] = nn.Parameter(torch.full((D,), -2.0))
    check_call(model, fn, x, what="after bias swap")


cfgmod = types.ModuleType("cfgmod")
cfgmod.FLAG = False  # type: ignore[attr-defined]


class FlagBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if cfgmod.FLAG:
            h = torch.relu(h)
        return h


def test_case10_flag_on_module_object_namespace() -> None:
    """`if cfgmod.FLAG:` where `cfgmod` is a `types.ModuleType` in globals, flipped between calls."""
    model = _stack(FlagBlock, 2)
    fn = stampout.compile(model, backend="eager")
    try:
        cfgmod.FLAG = False
        check_call(model, fn, _x(), what="FLAG=False")
        cfgmod.FLAG = True
        check_call(model, fn, _x(), what="FLAG=True")
        # capture, too: flipped between two region calls inside one program
        def prog(x: torch.Tensor) -> torch.Tensor:
            cfgmod.FLAG = False
            h = model[0](x)
            cfgmod.FLAG = True
            h = model[1](h)
            cfgmod.FLAG = False
            return h

        cap = check_capture(prog, _x(), params_of=model)
        assert cap.stats.traces == 2
    finally:
        cfgmod.FLAG = False


def test_case11_tensor_in_list_attribute_replaced() -> None:
    """`self.tables = [t]`, then `m.tables[0] = t2` between compiled calls."""

    class Tab(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(D, D)
            self.tables = [torch.ones(D)]

        @stampout.region
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * self.tables[0]

    model = _stack(Tab, 2)
    fn = stampout.compile(model, backend="eager")
    check_call(model, fn, _x(), what="first")
    model[0].tables[0] = torch.full((D,), 3.0)
    check_call(model, fn, _x(), what="after tables[0] swap")
    model[1].tables[0] = torch.full((D,), -1.0)
    check_call(model, fn, _x(), what="after second swap")


CALL_LOG: list[str] = []


@stampout.region
def _logged(x: torch.Tensor) -> torch.Tensor:
    CALL_LOG.append("called")
    return x + 1.0


def _logged_prog(x: torch.Tensor) -> torch.Tensor:
    return _logged(_logged(x))


def test_case12_global_list_append_replayed_every_call() -> None:
    """A region appending to a global list appends on every compiled call, as eager does (or the first call
    raises a StampoutError); a silent drop is the failure."""
    CALL_LOG.clear()
    fn = stampout.compile(_logged_prog, backend="eager")
    try:
        for i in range(3):
            before = len(CALL_LOG)
            try:
                out = fn(_x())
            except stampout.StampoutError:
                assert i == 0, "StampoutError is acceptable only at the first call"
                break
            torch.testing.assert_close(out, _x() + 2.0)
            assert len(CALL_LOG) == before + 2, f"call {i}: log grew by {len(CALL_LOG) - before}, eager grows by 2"
    finally:
        CALL_LOG.clear()


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.calls = 0

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x)


def test_case12_self_calls_counter_in_region() -> None:
    """`self.calls += 1` in a region's forward counts every compiled call."""
    model = _stack(Counting, 2)
    ref = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager")
    for _ in range(3):
        tree_assert_close(fn(_x()), ref(_x()), **TOL)
    assert [m.calls for m in ref] == [3, 3]
    assert [m.calls for m in model] == [3, 3]


def test_case12_self_calls_counter_top_level() -> None:
    """`self.calls += 1` in a compiled module's own forward (no region) counts every call."""

    class Top(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(D, D)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.fc(x) * self.calls

    torch.manual_seed(0)
    model = Top()
    ref = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager")
    for i in range(3):
        tree_assert_close(fn(_x()), ref(_x()), f"call {i}", **TOL)
    assert (ref.calls, model.calls) == (3, 3)


def test_case13_per_instance_forward_installed_after_first_call() -> None:
    """A per-instance forward installed on a submodule after the first compiled call."""
    model = _stack(Block, 3)
    fn = stampout.compile(model, backend="eager")
    check_call(model, fn, _x(), what="first")
    mlp = model[1].mlp
    mlp.forward = lambda x: mlp.fc(x) * -2.0
    check_call(model, fn, _x(), what="after patching layers[1].mlp.forward")
    model[2].forward = types.MethodType(lambda self, x: x * 0.5, model[2])
    check_call(model, fn, _x(), what="after patching layers[2].forward")


# --------------------------------------------------------------------------------------- 14-23: refusals


@pytest.mark.parametrize("mode", ["capture", "compile"])
@pytest.mark.parametrize("attr", ["T", "mT", "H"])
def test_case14_transposed_parameter_property(attr: str, mode: str) -> None:
    """`x @ self.w.T` (and `.mT`, `.H`) on a real-valued parameter."""

    class Proj(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(D + 1, D))

        @stampout.region
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x @ getattr(self.w, attr))[..., :D]

    model = _stack(Proj, 3)
    if mode == "capture":
        check_capture(model, _x(grad=True))
    else:
        fn = stampout.compile(model, backend="eager")
        check_call(model, fn, _x(grad=True))
        check_call(model, fn, _x(grad=True) * 2.0, what="second")


def _model_output_cls() -> type:
    from transformers.utils import ModelOutput

    @dataclass
    class Hidden(ModelOutput):
        hidden: torch.Tensor | None = None
        extra: torch.Tensor | None = None

    return Hidden


@pytest.mark.parametrize("kind", ["OrderedDict", "ModelOutput"])
def test_case15_ordereddict_and_model_output_inputs(kind: str) -> None:
    """An `OrderedDict` or a `transformers` `ModelOutput` subclass carrying tensors, as the input: its tensors
    are graph inputs (never baked), read per call."""
    make = OrderedDict if kind == "OrderedDict" else _model_output_cls()
    model = _stack(Block, 2)

    def prog(d: Any) -> torch.Tensor:
        return model(d["hidden"]) * d["extra"]

    cap = check_capture(prog, make(hidden=_x(grad=True), extra=torch.full((D,), 2.0)), params_of=model)
    other = make(hidden=_x() * 3.0, extra=torch.full((D,), -1.0))
    tree_assert_close(cap(other), prog(other), "capture on other values", **TOL)
    fn = stampout.compile(prog, backend="eager")
    check_call(prog, fn, make(hidden=_x(grad=True), extra=torch.full((D,), 2.0)), params_of=model)
    check_call(prog, fn, make(hidden=_x() * 3.0, extra=torch.full((D,), -1.0)), params_of=model, what="second")


class Triple(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 3.0


@pytest.mark.parametrize("mode", ["capture", "compile"])
def test_case16_custom_autograd_function_backward(mode: str) -> None:
    """A custom `autograd.Function` whose backward is not the derivative of its forward: gradients must equal
    eager's (refusing with a StampoutError is acceptable)."""

    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(D, D)

        @stampout.region
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Triple.apply(self.fc(x))

    model = _stack(Custom, 2)
    try:
        if mode == "capture":
            check_capture(model, _x(grad=True))
        else:
            fn = stampout.compile(model, backend="eager")
            check_call(model, fn, _x(grad=True))
    except stampout.StampoutError:
        pass  # refusing is acceptable; wrong gradients are not


def _closure_state_program() -> tuple[nn.Module, Callable[..., Any]]:
    """A region closing over module `m`; it updates `m.state` in place and reads it."""
    m = nn.Module()
    m.state = torch.zeros(D)

    @stampout.region
    def step(x: torch.Tensor) -> torch.Tensor:
        m.state.add_(x.sum(0))
        return m.state * 2.0

    def prog(x: torch.Tensor) -> torch.Tensor:
        return step(x) + 1.0

    return m, prog


def _closure_state_eager(ref: nn.Module, x: torch.Tensor) -> torch.Tensor:
    ref.state.add_(x.sum(0))
    return ref.state * 2.0 + 1.0


def test_case17_closure_module_tensor_reassigned_compiled() -> None:
    """Compiled: `m.state` (m reached through the region's closure) reassigned between calls and updated in
    place: every call updates and reads the tensor now at `m.state`."""
    m, prog = _closure_state_program()
    ref = nn.Module()
    x = _x()
    fn = stampout.compile(prog, backend="eager")
    for value in (0.0, 10.0, -5.0):
        fresh = torch.full((D,), value)
        m.state, ref.state = fresh, fresh.clone()
        for call in range(2):  # the second call keeps accumulating into the same tensor
            torch.testing.assert_close(fn(x), _closure_state_eager(ref, x), **TOL,
                                       msg=lambda msg, v=value, c=call: f"state={v} call {c}: {msg}")
            assert m.state is fresh
            torch.testing.assert_close(m.state, ref.state, **TOL)


def test_case17_closure_module_tensor_reassigned_captured() -> None:
    """Captured: the graph resolves `m.state` per call (never the tensor seen at capture time)."""
    m, prog = _closure_state_program()
    ref = nn.Module()
    x = _x()
    m.state = torch.zeros(D)
    cap = stampout.capture(prog, x)
    m.state, ref.state = torch.zeros(D), torch.zeros(D)  # capture ran the Python once; start both over
    torch.testing.assert_close(cap(x), _closure_state_eager(ref, x), **TOL)
    torch.testing.assert_close(m.state, ref.state, **TOL)
    fresh = torch.full((D,), 4.0)
    m.state, ref.state = fresh, fresh.clone()
    torch.testing.assert_close(cap(x), _closure_state_eager(ref, x), **TOL)
    torch.testing.assert_close(fresh, ref.state, **TOL)


def test_case18_nested_compile_region_on_module_instance() -> None:
    """`torch.compiler.nested_compile_region(module_instance)` as the region."""
    torch.manual_seed(0)
    layers = nn.ModuleList([Mlp() for _ in range(3)])
    blocks = [torch.compiler.nested_compile_region(layer) for layer in layers]

    def prog(x: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            x = x + b(x)
        return x

    cap = check_capture(prog, _x(grad=True), params_of=layers)
    assert cap.stats.traces == 1 and cap.stats.reuses == 2


class Plain:
    """A plain object returned by a region."""

    def __init__(self, h: torch.Tensor, tag: str) -> None:
        self.h, self.tag = h, tag


@stampout.region
def _as_object(x: torch.Tensor) -> Plain:
    return Plain(torch.tanh(x) * 2.0, "t")


@stampout.region
def _as_max(x: torch.Tensor) -> Any:
    return torch.max(x * 2.0, 0)


@stampout.region
def _appending(x: torch.Tensor, acc: list) -> torch.Tensor:
    h = torch.sin(x)
    acc.append(h)
    return h * 3.0


def _obj_prog(x: torch.Tensor) -> torch.Tensor:
    a = _as_object(x)
    b = _as_object(a.h)
    return b.h + (1.0 if b.tag == "t" else 0.0)


def _max_prog(x: torch.Tensor) -> torch.Tensor:
    v, i = _as_max(x)
    w, j = _as_max(x + 1.0)
    return v + w + i + j


def _list_prog(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    acc: list[torch.Tensor] = []
    h = _appending(_appending(x, acc), acc)
    return (h, *acc)


@pytest.mark.parametrize("prog", [_obj_prog, _max_prog, _list_prog], ids=["object", "return_types", "list_arg"])
def test_case19_region_returning_objects_and_return_types(prog: Callable[..., Any]) -> None:
    """Region outputs that are a plain object or a `torch.return_types` tuple, or an intermediate appended to
    a list argument."""
    check_capture(prog, _x(grad=True))
    fn = stampout.compile(prog, backend="eager")
    check_call(prog, fn, _x(grad=True), what="first")
    check_call(prog, fn, _x(grad=True) * 2.0, what="second")


def test_case19_program_returning_return_types() -> None:
    """A program returning `torch.max(x, 0)` itself returns real tensors, in a `torch.return_types.max`."""

    def top_max(x: torch.Tensor) -> Any:
        return torch.max(x, 0)

    x = _x()
    cap = stampout.capture(top_max, x)
    out, ref = cap(x), top_max(x)
    assert all(type(t) is torch.Tensor for t in out), f"captured: {[type(t).__name__ for t in out]}"
    tree_assert_close(out, ref)
    fn = stampout.compile(top_max, backend="eager")
    for scale in (1.0, -2.0):
        out = fn(x * scale)
        assert all(type(t) is torch.Tensor for t in out), f"compiled: {[type(t).__name__ for t in out]}"
        tree_assert_close(out, top_max(x * scale))


@stampout.region
def _affine(x: torch.Tensor, cfg: Any) -> torch.Tensor:
    return x * cfg.scale + cfg.bias


@dataclass
class AffineCfg:
    scale: float
    bias: torch.Tensor


def _ns_prog(x: torch.Tensor) -> torch.Tensor:
    cfg = types.SimpleNamespace(scale=2.0, bias=x.new_ones(D) * x.sum())
    return _affine(_affine(x, cfg), cfg)


def _dc_prog(x: torch.Tensor) -> torch.Tensor:
    cfg = AffineCfg(scale=0.5, bias=torch.arange(D, dtype=x.dtype))
    return _affine(_affine(x, cfg), cfg)


def _dc_prog_derived(x: torch.Tensor) -> torch.Tensor:
    cfg = AffineCfg(scale=0.5, bias=x.mean(0))
    return _affine(_affine(x, cfg), cfg)


@pytest.mark.parametrize("prog", [_ns_prog, _dc_prog, _dc_prog_derived], ids=["namespace", "dataclass", "derived"])
def test_case20_compile_program_building_an_object_for_a_region(prog: Callable[..., Any]) -> None:
    """A compiled program builds a SimpleNamespace / dataclass holding a tensor and passes it to a region."""
    check_capture(prog, _x(grad=True))
    fn = stampout.compile(prog, backend="eager")
    check_call(prog, fn, _x(grad=True), what="first")
    check_call(prog, fn, _x(grad=True) * 2.0, what="second")


class KwAttn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(0).chunk(3, dim=-1)
        return x + F.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=True)[0]


class RegionKwAttn(KwAttn):
    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def _sdpa_twice(q: torch.Tensor) -> torch.Tensor:
    h = F.scaled_dot_product_attention(query=q, key=q, value=q)
    return F.scaled_dot_product_attention(query=h, key=h, value=h)


def _add_twice(q: torch.Tensor) -> torch.Tensor:
    return torch.add(input=q, other=q) * torch.add(input=q, other=q)


@pytest.mark.parametrize("what", ["flat_stack", "region_stack", "sdpa_twice", "add_twice"])
def test_case21_torch_call_with_keyword_tensors_only(what: str) -> None:
    """`F.scaled_dot_product_attention(query=q, key=k, value=v)`: every tensor passed by keyword, the same
    call made more than once in a capture."""
    if what == "flat_stack":
        prog: Callable[..., Any] = _stack(KwAttn, 3)
    elif what == "region_stack":
        prog = _stack(RegionKwAttn, 3)
    else:
        prog = _sdpa_twice if what == "sdpa_twice" else _add_twice
    x = _x(3, D, grad=True) if isinstance(prog, nn.Module) else _x(1, 3, D, grad=True)
    check_capture(prog, x)
    fn = stampout.compile(prog, backend="eager")
    check_call(prog, fn, x)


class Split(nn.Module):
    """Takes two halves, returns two views of one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * D, 2 * D)

    @stampout.region
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.fc(torch.cat([a, b], dim=-1)))
        return h[:, :D], h[:, D:]


class SplitStack(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Split() for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x[:, :D], x[:, D:]
        for layer in self.layers:
            a, b = layer(a, b)
        return a * 2.0 + b


@pytest.mark.inductor
def test_case22_inductor_region_returning_two_views() -> None:
    """Inductor: a region returning `h[:, :n], h[:, n:]` threaded through a stack."""
    model = SplitStack(2)
    x = _x(2, 2 * D, grad=True)
    fn = stampout.compile(model, backend="inductor")
    check_call(model, fn, x)
    check_call(model, fn, x * 0.5, what="second")


def test_case23_stamped_outputs_keep_storage_offset() -> None:
    """Stamped-out view outputs keep their storage offset, so a stack of 4 two-view blocks traces once."""
    model = SplitStack(4)
    cap = check_capture(model, _x(2, 2 * D, grad=True))
    assert (cap.stats.traces, cap.stats.reuses) == (1, 3)


# --------------------------------------------------------------- families found beyond the 23 cases


class TypeChecked(nn.Module):
    """Branches on `type(self.act) is nn.Tanh` (exact class, as some model code does)."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.act = act

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if type(self.act) is nn.Tanh:
            return x + self.act(h)
        return x + h * 0.5


def test_family_exact_type_checks_see_the_real_class() -> None:
    """`type(m) is Cls` inside a captured program must see the user's class, not a tracking shim."""
    torch.manual_seed(0)
    check_capture(nn.Sequential(TypeChecked(nn.Tanh()), TypeChecked(nn.Sigmoid())), _x(grad=True))
    torch.manual_seed(0)
    model = nn.Sequential(TypeChecked(nn.Tanh()), TypeChecked(nn.Tanh()))
    fn = stampout.compile(model, backend="eager")
    check_call(model, fn, _x(grad=True))


class DictReader(nn.Module):
    def __init__(self, how: str, scale: float) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.how = how
        self.scale = scale

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.__dict__["scale"] if self.how == "dict" else vars(self)["scale"]
        return x + torch.tanh(self.fc(x)) * s


@pytest.mark.parametrize("how", ["dict", "vars"])
def test_family_reads_through_instance_dict_are_guarded(how: str) -> None:
    """`self.__dict__["scale"]` / `vars(self)["scale"]` differing per layer."""
    torch.manual_seed(0)
    model = nn.Sequential(DictReader(how, 0.5), DictReader(how, -2.0))
    check_capture(model, _x(grad=True))


ENV_NAME = "STAMPOUT_SOUNDNESS_FLAG"


class EnvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if os.environ.get(ENV_NAME) == "1":
            h = torch.relu(h) * 3.0
        return x + h


def test_family_environment_variable_reads() -> None:
    """`os.environ.get(...)` read by a region, changed between region calls and between compiled calls."""
    model = _stack(EnvBlock, 2)

    def prog(x: torch.Tensor) -> torch.Tensor:
        os.environ[ENV_NAME] = "0"
        h = model[0](x)
        os.environ[ENV_NAME] = "1"
        return model[1](h)

    try:
        check_capture(prog, _x(grad=True), params_of=model)
        os.environ[ENV_NAME] = "0"
        fn = stampout.compile(model, backend="eager")
        check_call(model, fn, _x(grad=True), what="flag 0")
        os.environ[ENV_NAME] = "1"
        check_call(model, fn, _x(grad=True), what="flag 1")
    finally:
        os.environ.pop(ENV_NAME, None)


G_SCALE = 0.5


def _scaled_inner(h: torch.Tensor) -> torch.Tensor:
    return h * G_SCALE


def _scaled_outer(h: torch.Tensor) -> torch.Tensor:
    return _scaled_inner(h) + 1.0


@stampout.region
def _chain_region(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(_scaled_outer(x))


def _chain_prog(x: torch.Tensor) -> torch.Tensor:
    return _chain_region(x) * 2.0


def test_family_global_read_by_a_nested_helper() -> None:
    """A region calls a module-level helper that calls another one that reads a global."""
    global G_SCALE

    def prog(x: torch.Tensor) -> torch.Tensor:
        global G_SCALE
        G_SCALE = 0.5
        h = _chain_region(x)
        G_SCALE = -3.0
        return _chain_region(h)

    try:
        cap = check_capture(prog, _x(grad=True))
        assert cap.stats.traces == 2
        G_SCALE = 0.5
        fn = stampout.compile(_chain_prog, backend="eager")
        check_call(_chain_prog, fn, _x(grad=True), what="G_SCALE=0.5")
        G_SCALE = 2.0
        check_call(_chain_prog, fn, _x(grad=True), what="G_SCALE=2.0")
    finally:
        G_SCALE = 0.5


_COMPILE_REGION_SCRIPT = """
import torch, stampout

@stampout.region
def layer(x):
    return torch.tanh(x) * 2.0

fn = stampout.compile(layer, backend="eager")
x = torch.randn(2, 4)
torch.testing.assert_close(fn(x), layer(x))
torch.testing.assert_close(fn(x * 2), layer(x * 2))
cap = stampout.capture(lambda t: layer(t) + 1.0, x)  # the process still works afterwards
torch.testing.assert_close(cap(x), layer(x) + 1.0)
print("OK")
"""


def test_family_compile_a_region_function_directly() -> None:
    """`stampout.compile(f)` where `f` is itself a `stampout.region` (run in a subprocess: a failure here has
    been seen to leave the process unable to capture anything)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _COMPILE_REGION_SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


@dataclass(slots=True)
class Slots:
    s: float = 0.5


class Configured(nn.Module):
    """Reads its scale from the one holder named by `which` (nothing else, so nothing else decides reuse)."""

    def __init__(self, which: str) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.which = which
        self.cfg = {"s": 0.5}
        self.items = [0.5]
        self.slots = Slots()
        self.ns = types.SimpleNamespace(s=0.5)
        self.raw = 0.5
        self.opt = 0.5
        self.perm = [0, 1, 2, 3]
        self.fc.weight.scale = 0.5  # a Python attribute on a parameter

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.which == "dict_item":
            h = h * self.cfg["s"]
        elif self.which == "list_item":
            h = h * self.items[0]
        elif self.which == "slots_field":
            h = h * self.slots.s
        elif self.which == "namespace_field":
            h = h * self.ns.s
        elif self.which in ("instance_dict_write", "object_setattr"):
            h = h * self.raw
        elif self.which == "list_in_place":
            h = h[:, self.perm]
        elif self.which == "delattr":
            h = h * getattr(self, "opt", 3.0)
        else:
            h = h * self.fc.weight.scale
        return x + torch.tanh(h)


MUTATIONS: dict[str, Callable[[Configured], None]] = {
    "dict_item": lambda m: m.cfg.__setitem__("s", 2.0),
    "list_item": lambda m: m.items.__setitem__(0, -1.0),
    "slots_field": lambda m: setattr(m.slots, "s", 3.0),
    "namespace_field": lambda m: setattr(m.ns, "s", -3.0),
    "instance_dict_write": lambda m: m.__dict__.__setitem__("raw", -2.0),
    "object_setattr": lambda m: object.__setattr__(m, "raw", 4.0),
    "list_in_place": lambda m: m.perm.reverse(),
    "delattr": lambda m: delattr(m, "opt"),
    "param_python_attr": lambda m: setattr(m.fc.weight, "scale", -0.5),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_family_compiled_guards_see_mutations_that_bypass_setattr(mutation: str) -> None:
    """Between compiled calls: in-place container edits, slots and SimpleNamespace fields, `__dict__` /
    `object.__setattr__` writes, `del`, and Python attributes of parameters all change what the region
    computes."""
    torch.manual_seed(0)
    model = nn.Sequential(Configured(mutation), Configured(mutation))
    fn = stampout.compile(model, backend="eager")
    check_call(model, fn, _x(grad=True), what="first")
    MUTATIONS[mutation](model[1])
    check_call(model, fn, _x(grad=True), what=f"after {mutation}")


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_family_capture_sees_per_layer_values_in_every_holder(mutation: str) -> None:
    """The same holders, differing between two layers of one captured stack."""
    torch.manual_seed(0)
    model = nn.Sequential(Configured(mutation), Configured(mutation))
    MUTATIONS[mutation](model[1])
    check_capture(model, _x(grad=True))


class ClassScaled(nn.Module):
    scale = 0.5

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    @classmethod
    def factor(cls) -> float:
        return cls.scale

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x) * self.factor())


def test_family_class_attribute_changed() -> None:
    """`Cls.scale = ...` (read through a classmethod) changed between region calls and between compiled calls."""
    model = _stack(ClassScaled, 2)

    def prog(x: torch.Tensor) -> torch.Tensor:
        ClassScaled.scale = 0.5
        h = model[0](x)
        ClassScaled.scale = -2.0
        h = model[1](h)
        ClassScaled.scale = 0.5
        return h

    check_capture(prog, _x(grad=True), params_of=model)
    fn = stampout.compile(model, backend="eager")
    try:
        check_call(model, fn, _x(grad=True), what="scale=0.5")
        ClassScaled.scale = 3.0
        check_call(model, fn, _x(grad=True), what="scale=3.0")
    finally:
        ClassScaled.scale = 0.5


class Dice(nn.Module):
    """LayerDrop-style: a Python RNG decides per call (seeded, so eager is reproducible)."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.rng = rng

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.rng.random() < 0.5:
            h = h * -2.0
        return x + torch.tanh(h)


def test_family_python_rng_in_a_region() -> None:
    """Each region call draws from a Python RNG: a stamped-out call must not skip the draw (or stampout must
    refuse)."""
    torch.manual_seed(0)
    rng = random.Random(0)
    model = nn.Sequential(*[Dice(rng) for _ in range(4)])
    ref = copy.deepcopy(model)  # its own copy of the RNG, in the same state
    try:
        cap = stampout.capture(model, _x())
    except stampout.StampoutError:
        return
    tree_assert_close(cap(_x()), ref(_x()), **TOL)
    assert rng.getstate() == ref[0].rng.getstate(), "the capture drew a different number of values than eager"


class Cached(nn.Module):
    """The rotary-embedding pattern: a tensor cache built lazily inside forward and stored on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.cache: torch.Tensor | None = None

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None or self.cache.shape[0] < x.shape[0]:
            self.cache = torch.arange(x.shape[0] * D, dtype=x.dtype).view(x.shape[0], D) / 10
        return self.fc(x) + self.cache[: x.shape[0]]


def test_family_tensor_stored_on_module_during_capture() -> None:
    """A tensor made and stored on `self` inside the captured program is left there as a real tensor (as eager
    leaves it), and the model still runs eagerly afterwards."""
    model = _stack(Cached, 2)
    ref = copy.deepcopy(model)
    cap = stampout.capture(model, _x())
    tree_assert_close(cap(_x()), ref(_x()), **TOL)
    for i, layer in enumerate(model):
        assert type(layer.cache) is torch.Tensor, f"layers[{i}].cache is a {type(layer.cache).__name__}"
    tree_assert_close(model(_x()), ref(_x()), "eager after capture", **TOL)


class DataSetter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.ones(D))
        self.replacement = torch.full((D,), 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale.data = self.replacement  # e.g. weight loading / pruning code in forward
        return self.fc(x) * self.scale


def test_family_param_data_assignment_in_program() -> None:
    """`param.data = tensor` inside a captured program."""
    torch.manual_seed(0)
    check_capture(DataSetter(), _x())


def test_family_parametrization_removed_after_compile() -> None:
    """`torch.nn.utils.parametrize` registered / removed between compiled calls (LoRA-style tooling)."""

    class Double(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2.0

    model = _stack(Block, 2)
    fn = stampout.compile(model, backend="eager")
    check_call(model, fn, _x(grad=True), what="plain")
    parametrize.register_parametrization(model[1].mlp.fc, "weight", Double())
    check_call(model, fn, _x(grad=True), what="parametrized")
    parametrize.remove_parametrizations(model[1].mlp.fc, "weight", leave_parametrized=False)
    check_call(model, fn, _x(grad=True), what="parametrization removed")
