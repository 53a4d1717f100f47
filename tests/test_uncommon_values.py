"""Values beyond plain tensors going into, through and out of regions and programs: parameter properties (`.T`),
OrderedDict and ModelOutput inputs, closures over module tensors, `nested_compile_region` on an instance,
objects and return types, objects built for a region, keyword-only tensors, views and storage offsets, tensor
subclasses. Each equals eager or is refused with a reason."""

from __future__ import annotations

import logging
import types
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from blocks import Block, D, Mlp, sample, stack_of
from helpers import TOL, check_call, check_capture, tree_assert_close
from torch import nn

import stampout


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

    model = stack_of(Proj, 3)
    if mode == "capture":
        check_capture(model, sample(grad=True))
    else:
        fn = stampout.compile(model, backend="eager")
        check_call(model, fn, sample(grad=True))
        check_call(model, fn, sample(grad=True) * 2.0, what="second")


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
    model = stack_of(Block, 2)

    def prog(d: Any) -> torch.Tensor:
        return model(d["hidden"]) * d["extra"]

    cap = check_capture(prog, make(hidden=sample(grad=True), extra=torch.full((D,), 2.0)), params_of=model)
    other = make(hidden=sample() * 3.0, extra=torch.full((D,), -1.0))
    tree_assert_close(cap(other), prog(other), "capture on other values", **TOL)
    fn = stampout.compile(prog, backend="eager")
    check_call(prog, fn, make(hidden=sample(grad=True), extra=torch.full((D,), 2.0)), params_of=model)
    check_call(prog, fn, make(hidden=sample() * 3.0, extra=torch.full((D,), -1.0)), params_of=model, what="second")


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
    x = sample()
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
    x = sample()
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

    cap = check_capture(prog, sample(grad=True), params_of=layers)
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
    check_capture(prog, sample(grad=True))
    fn = stampout.compile(prog, backend="eager")
    check_call(prog, fn, sample(grad=True), what="first")
    check_call(prog, fn, sample(grad=True) * 2.0, what="second")


def test_case19_program_returning_return_types() -> None:
    """A program returning `torch.max(x, 0)` itself returns real tensors, in a `torch.return_types.max`."""

    def top_max(x: torch.Tensor) -> Any:
        return torch.max(x, 0)

    x = sample()
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
    check_capture(prog, sample(grad=True))
    fn = stampout.compile(prog, backend="eager")
    check_call(prog, fn, sample(grad=True), what="first")
    check_call(prog, fn, sample(grad=True) * 2.0, what="second")


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
        prog: Callable[..., Any] = stack_of(KwAttn, 3)
    elif what == "region_stack":
        prog = stack_of(RegionKwAttn, 3)
    else:
        prog = _sdpa_twice if what == "sdpa_twice" else _add_twice
    x = sample(3, D, grad=True) if isinstance(prog, nn.Module) else sample(1, 3, D, grad=True)
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
    x = sample(2, 2 * D, grad=True)
    fn = stampout.compile(model, backend="inductor")
    check_call(model, fn, x)
    check_call(model, fn, x * 0.5, what="second")


def test_case23_stamped_outputs_keep_storage_offset() -> None:
    """Stamped-out view outputs keep their storage offset, so a stack of 4 two-view blocks traces once."""
    model = SplitStack(4)
    cap = check_capture(model, sample(2, 2 * D, grad=True))
    assert (cap.stats.traces, cap.stats.reuses) == (1, 3)


class Tagged(torch.Tensor):
    pass


class SubclassBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 if isinstance(x, Tagged) else y


def test_a_tensor_subclass_input_runs_eagerly_and_capture_refuses(caplog):
    torch.manual_seed(0)
    model = SubclassBranch()
    fn = stampout.compile(model, backend="eager")
    with caplog.at_level(logging.WARNING, logger="stampout"):
        for tag in (False, True, False):
            x = torch.randn(2, 4)
            x = x.as_subclass(Tagged) if tag else x
            torch.testing.assert_close(fn(x).as_subclass(torch.Tensor), model(x).as_subclass(torch.Tensor))
    assert any("Tagged" in r.getMessage() for r in caplog.records)
    with pytest.raises(stampout.CaptureError, match="Tagged"):
        stampout.capture(model, torch.randn(2, 4).as_subclass(Tagged))


_SETTINGS = types.ModuleType("settings_passed_in")  # a user module, passed to a region as an argument
_SETTINGS.SCALE = 2.0


@stampout.region
def _scaled_by(x: torch.Tensor, settings: types.ModuleType) -> torch.Tensor:
    return x * settings.SCALE


def _passes_a_module(x: torch.Tensor) -> torch.Tensor:
    return _scaled_by(x, _SETTINGS) + _scaled_by(x, _SETTINGS)


def test_a_user_module_passed_to_a_region() -> None:
    # The region frame set up its module-namespace reads only after guarding the arguments, so a module among
    # them (guarded whole, as a module used as a value is) raised AttributeError out of the capture.
    x = torch.randn(3)
    cap = stampout.capture(_passes_a_module, x)
    assert (cap.stats.traces, cap.stats.reuses) == (1, 1)
    torch.testing.assert_close(cap(x), _passes_a_module(x))
    compiled = stampout.compile(_passes_a_module, backend="eager")
    torch.testing.assert_close(compiled(x), x * 4)
    _SETTINGS.SCALE = 3.0
    try:
        torch.testing.assert_close(compiled(x), x * 6)
    finally:
        _SETTINGS.SCALE = 2.0


def test_numpy_scalars_as_op_arguments_match_eager():
    # A NumPy scalar in an op's arguments reached the FX code as NumPy 2's repr (`np.float64(2.0)`), which the
    # generated forward cannot name; it is the Python scalar it stands for (result dtypes as in eager).
    np = pytest.importorskip("numpy")

    class Scaled(nn.Module):
        def __init__(self, c) -> None:
            super().__init__()
            self.c = c

        def forward(self, x):
            return torch.div(x, self.c), torch.add(x, self.c), torch.full((2,), self.c)

    for c in (np.float64(2.0), np.float32(0.1), np.int64(3)):
        for x in (torch.ones(2), torch.ones(2, dtype=torch.int32)):
            model = Scaled(c)
            for want, got in zip(model(x), stampout.compile(model, backend="eager")(x)):
                assert got.dtype == want.dtype and torch.equal(got, want), (c, x.dtype)


class _AttrDict(OrderedDict):
    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class _Plain(dict):
    pass


class _ReturnsDictSubclasses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple:
        y = self.lin(x)
        return _AttrDict(logits=y, n=x.shape[0]), _Plain(doubled=y * 2)


def test_a_users_dict_subclass_output_is_rebuilt_not_refused() -> None:
    """A dict or OrderedDict subclass of the user's, made by the dict's own constructor and holding no attributes,
    comes back as its class with the call's tensors (was: capture refused it as an object carrying traced tensors,
    and compile ran the program eagerly on every call)."""
    torch.manual_seed(0)
    model = _ReturnsDictSubclasses()
    x = torch.randn(2, 4, requires_grad=True)
    cap = stampout.capture(model, x)
    for got in (cap(x), stampout.compile(model, backend="aot_eager")(x)):
        expected = model(x)
        assert type(got[0]) is _AttrDict and type(got[1]) is _Plain and got[0].n == 2
        torch.testing.assert_close(got[0].logits, expected[0].logits)
        torch.testing.assert_close(got[1]["doubled"], expected[1]["doubled"])


class _Slotted(dict):
    __slots__ = ("meta",)


def _returns_a_slotted_dict(x: torch.Tensor) -> _Slotted:
    out = _Slotted(logits=x * 2)
    out.meta = "step"
    return out


def test_a_dict_subclass_output_with_a_slot_set_keeps_it() -> None:
    """A dict subclass whose instance holds a `__slots__` field is not rebuilt from its items (that would leave the
    field unset: was `AttributeError: meta` on the compiled call's output, silently): capture refuses it as a
    constant carrying traced tensors, compile runs it eagerly."""
    x = torch.randn(2, 4)
    with pytest.raises(stampout.StampoutError):
        stampout.capture(_returns_a_slotted_dict, x)
    fn = stampout.compile(_returns_a_slotted_dict, backend="eager")
    for _ in range(2):
        got = fn(x)
        assert type(got) is _Slotted and got.meta == "step"
        torch.testing.assert_close(got["logits"], x * 2)
