"""Red-team round 3 (soundness3): ordinary programs that touch the world from traced code, each run through
`stampout.compile` and compared with eager over several calls with changes between them: outputs, gradients and
the side effects on the caller's objects. Also the leftovers of earlier rounds: an eager entry guarded by the
identity that made its program ineligible."""

from __future__ import annotations

import functools

import pytest
import torch
from redteam3_programs import PROGRAMS
from redteam_battery import calls
from torch import nn

import stampout

# The battery runs as users run it (STAMPOUT_CHECK_WORLD off: a fake left in user state shows as a wrong result); the
# other tests here run both ways (conftest.UNCHECKED_TOO).
UNCHECKED_ONLY = ("test_an_ordinary_program_matches_eager",)

# Programs whose gradients, RNG draws or in-place updates go through AOTAutograd differently: also under aot_eager.
_THROUGH_AOT = {
    "tensor_hook_scale", "tensor_hook_record", "checkpoint_block", "autograd_function_ctx", "autocast_inside",
    "grad_modes_inside", "retain_grad_debug", "gradient_penalty", "actnorm_data_init", "batchnorm_toggle",
    "autograd_function_global_count", "rg_tensor_hook", "rg_checkpoint", "ema_teacher_lazy", "dropout_rng",
    "rg_dropout", "inplace_input_and_param", "kv_cache_cat", "nested_regions", "torch_cond",
}
_CASES = [(name, "eager") for name in PROGRAMS] + [(name, "aot_eager") for name in PROGRAMS if name in _THROUGH_AOT]


def _same(got, expected, path="out"):
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        torch.testing.assert_close(got, expected, msg=lambda m: f"{path}: {m}")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), f"{path}: {got!r} vs {expected!r}"
        for i, (g, e) in enumerate(zip(got, expected)):
            _same(g, e, f"{path}[{i}]")
    elif isinstance(expected, dict):
        assert list(got) == list(expected), f"{path}: keys {list(got)} vs {list(expected)}"
        for k in expected:
            _same(got[k], expected[k], f"{path}[{k!r}]")
    else:
        assert got == expected, f"{path}: {got!r} vs {expected!r}"


# ---- leftovers: the eager entry of a program that reads its own input is guarded by that identity ------------------

class ReadsHeld(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.ref = torch.zeros(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.ref * 2


def test_reading_the_input_runs_eagerly_only_while_it_is_the_input():
    """`self.ref` is `x` on the first call: that call runs eagerly (the trace would see two tensors where eager has
    one). Later calls where `self.ref` is another tensor are captured (once) and compiled; a call where it is the
    input again runs eagerly again, right."""
    torch.manual_seed(0)
    model = ReadsHeld()
    fn = stampout.compile(model, backend="eager")
    x = torch.randn(2, 4)
    model.ref = x
    _same(fn(x), model(x))
    before = fn.stats.captures
    y = torch.randn(2, 4)
    model.ref = torch.randn(2, 4)
    _same(fn(y), model(y))
    assert fn.stats.captures == before + 1  # (captured, not the eager entry of the first call)
    _same(fn(x), model(x))
    assert fn.stats.captures == before + 1  # (the compiled entry, guarded by the shapes and the distinct identity)
    model.ref = y
    _same(fn(y), model(y))  # (the read tensor is the input again: eagerly)
    _same(fn(x), model(x))
    assert fn.stats.captures == before + 1


class MemoOnInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self._x = None
        self._y = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._x is x:
            return self._y
        self._x, self._y = x, self.lin(x)
        return self._y


def test_capture_refuses_a_module_that_holds_its_input():
    """`stampout.capture` of a module whose memo holds the very tensor it is given (primed by an eager call): the trace
    gets a fake for `x` and the real tensor at `self._x`, so `self._x is x` is False there and True in eager (which
    returns its cached output, stale after a weight change). capture cannot run it eagerly: it refuses, naming the
    attribute; on another tensor it captures."""
    torch.manual_seed(0)
    model = MemoOnInput()
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    with torch.no_grad():
        model(a)
        with pytest.raises(stampout.StampoutError, match=r"MemoOnInput._x holds the input x"):
            stampout.capture(model, a)
        cap = stampout.capture(model, b)
        _same(cap(b), model.lin(b))


def _variadic_hook(module, args, *rest):
    return rest[-1] * (3 if len(rest) == 2 else 1)  # (module, args, kwargs, out) when run with kwargs


def test_a_hook_flag_written_into_the_modules_dict_is_guarded():
    """How a module call runs a forward hook (with kwargs, always called) lives in dicts beside `_forward_hooks`, by
    the handle's id: a write into one of them changes the call as much as a new hook, and the hooks guard sees it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    handle = model[0].register_forward_hook(_variadic_hook)
    fn = stampout.compile(model, backend="eager")
    x = torch.randn(2, 4)
    _same(fn(x), model(x))
    model[0]._forward_hooks_with_kwargs[handle.id] = True
    _same(fn(x), model(x))
    del model[0]._forward_hooks_with_kwargs[handle.id]
    _same(fn(x), model(x))


def _two_classes_a_grown_set_reorders() -> tuple[type, type, list[type]]:
    """Two module classes whose set iterates in another order once it grew (by `extra`) and shrank again."""
    extra = [type(f"K{i}", (), {}) for i in range(200)]
    for _ in range(2000):  # (about one pair in 30 reorders: hashes are addresses)
        a = type("A", (nn.Module,), {"forward": lambda self, x: x})
        b = type("B", (nn.Module,), {"forward": lambda self, x: x})
        grown = {a, b}
        before = list(grown)
        grown.update(extra)
        grown.difference_update(extra)
        if list(grown) != before:
            return a, b, extra
    raise AssertionError("no pair of 2000 reorders once its set grew and shrank: the test's premise fails")


def test_a_registry_set_iterated_in_another_order():
    """`for cls in REGISTRY: if isinstance(self.kind, cls)` takes the first match; a set with the same classes
    iterates in another order after it grew and shrank. The guard compares the order, and the capture leaves the set
    as it found it (refilled, its table would shrink back and iterate in the old order)."""
    a, b, extra = _two_classes_a_grown_set_reorders()
    both = type("AB", (a, b), {})
    scale = {a: 2.0, b: 3.0}
    registry = {a, b}

    class Dispatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.kind = both()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for cls in registry:
                if isinstance(self.kind, cls):
                    return self.lin(x) * scale[cls]
            return self.lin(x)

    model = Dispatch()
    fn = stampout.compile(model, backend="eager")
    x = torch.randn(2, 4)
    _same(fn(x), model(x))
    registry.update(extra)
    registry.difference_update(extra)
    _same(fn(x), model(x))
    _same(fn(x), model(x))


class Accumulates(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("acc", torch.zeros(2, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.acc.add_(y)  # (not detached: the buffer takes autograd history, eager's backward never reaches it)
        return y.sum()


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_a_buffer_accumulating_a_grad_requiring_value(backend):
    """After the first call the buffer has autograd history; a graph through AOTAutograd that updates it in place
    joins its backward to that history (the next backward ran through the first call's freed graph). Such a call
    runs eagerly; a buffer detached again is compiled again."""
    torch.manual_seed(0)
    model, reference = Accumulates(), Accumulates()
    reference.load_state_dict(model.state_dict())
    fn = stampout.compile(model, backend=backend)
    for i in range(4):
        if i == 3:
            model.acc, reference.acc = model.acc.detach(), reference.acc.detach()
        x = torch.randn(2, 4)
        for m, call in ((reference, reference), (model, fn)):
            m.zero_grad(set_to_none=True)
            call(x).backward()
        _same(model.lin.weight.grad, reference.lin.weight.grad)
        _same(model.acc, reference.acc)


@pytest.mark.parametrize(("name", "backend"), _CASES)
def test_an_ordinary_program_matches_eager(name, backend):
    """Outputs, gradients and the caller's objects after each of five calls, with the changes a user makes between
    them, as eager gives them: what the traced code touches outside the watched objects is guarded, replayed, undone,
    or runs eagerly."""
    with stampout.config.patch(check_world=False):
        expected = calls(PROGRAMS, name, None)
        got = calls(PROGRAMS, name, backend)
    for i, (g, e) in enumerate(zip(got, expected)):
        _same(g, e, f"call {i}")


@pytest.mark.parametrize("name", ["set_pop_queue", "path_exists_branch"])
def test_hidden_state_of_the_standard_library_is_not_baked(name):
    """`set.pop` takes the member after the set's earlier pops (a search finger that refilling the set does not put
    back: the trace's pop, undone, made the eager call that followed pop another member); `os.path.exists` stats the
    disk from Python 3.11's frozen `genericpath` (its C calls were not checked: the first answer was baked). Both make
    the program run eagerly."""
    with stampout.config.patch(check_world=False):
        _same(calls(PROGRAMS, name, "eager"), calls(PROGRAMS, name, None))


_TABLE_CFG = {"scale": 1.0}


@functools.cache
def _scaled_table(n: int) -> torch.Tensor:
    return torch.full((n,), _TABLE_CFG["scale"])


class UsesCachedTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + _scaled_table(x.shape[-1])


def test_a_functools_cache_the_trace_fills_keeps_eagers_value():
    """Eager computes `_scaled_table(4)` once and hits the cache afterwards (a later change of the config it read is
    not seen). The trace's value was taken out of the cache, so the compiled program computed the table on every call,
    from the config as it is then: that first call now runs eagerly (filling the cache), the next captures and hits."""
    outputs = []
    for wrap in (lambda m: m, lambda m: stampout.compile(m, backend="eager")):
        _scaled_table.cache_clear()
        _TABLE_CFG["scale"] = 1.0
        torch.manual_seed(0)
        call = wrap(UsesCachedTable())
        outputs.append([])
        for i in range(4):
            if i == 2:
                _TABLE_CFG["scale"] = 5.0
            outputs[-1].append(call(torch.ones(2, 4)).detach())
    _TABLE_CFG["scale"] = 1.0
    _same(outputs[1], outputs[0])


class HeldInContainer(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 4)
        self.held: object = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.held is None:
            self.held = {"tuple": lambda: (x, 1), "list": lambda: [1, x], "dict": lambda: {"x": x}}[self.kind]()
        return self.lin(x)


@pytest.mark.parametrize("kind", ["tuple", "list", "dict"])
def test_capture_refuses_a_deep_module_that_holds_its_input_in_a_container(kind):
    """The input held as an item of a tuple, list or dict attribute of a module deep in the tree (the module-tree pass
    looks into each module's containers, not only at its attributes): refused, naming the attribute."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), HeldInContainer(kind)))
    x = torch.randn(2, 4)
    with torch.no_grad():
        model[1][1](x)
        with pytest.raises(stampout.StampoutError, match=r"HeldInContainer.held holds the input"):
            stampout.capture(model, x)
        y = torch.randn(2, 4)
        cap = stampout.capture(model, y)
        _same(cap(y), model(y))
