"""The differential check, in one place: run a program eagerly and through stampout on fresh clones of the same
inputs, and assert that everything a user can see is the same — outputs, the inputs after the call (in-place
writes), gradients of parameters and leaf inputs, buffers, and whatever the test says the program changes outside
its inputs (`world()`).

* `assert_matches_eager(model, *args, grad=True)`: the reference is a deep copy of the model made before capturing;
  `stampout.capture`, `graph.lint()`, then the Capture against the copy. Returns the Capture.
* `check(fn, *args, traces=.., reuses=.., world=.., reset=..)`: on the live objects (no copy), eager vs capture vs
  `stampout.compile` for `calls` calls, with exact trace/reuse counts; PyTorch's own reuse tests use it.
* `check_capture(fn, *args)` / `check_call(eager, compiled, *args)`: one capture, or one compiled call, against
  eager on the same live state.
* Underneath: `run()` records one call as a `Run`, `assert_same()` compares two of them.

from helpers import assert_matches_eager, check   # or: from tests.helpers import ...

cap = assert_matches_eager(model, x, grad=True)
assert cap.stats.traces == 1
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import stampout

# torch 2.14's fake group_norm of a channels-last CPU input is contiguous while its CPU kernel keeps channels-last
# (in 2.13 both keep it; torch.compile reads the same fake): a capture that branches on that layout takes the
# fake's branch. Tests that show it fail on 2.14 until torch's fake kernel agrees (strict: they pass again then).
TORCH_214_FAKE_GROUP_NORM = pytest.mark.xfail(torch.__version__ >= "2.14", strict=True,
                                              reason="torch 2.14's fake group_norm strides (channels-last input)")

__all__ = [
    "TOL",
    "Run",
    "assert_matches_eager",
    "assert_same",
    "check",
    "check_call",
    "check_capture",
    "named_grads",
    "run",
    "same",
    "scalar_loss",
    "summed_loss",
    "traced",
    "tree_assert_close",
    "tree_clone",
    "tree_leaves",
]

TOL = {"rtol": 1e-4, "atol": 1e-5}


# ------------------------------------------------------------------------------------ pytree walks


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def tree_leaves(x: Any) -> Iterator[Any]:
    """Leaves of a pytree made of tuples, lists, dicts (incl. OrderedDict / HF ModelOutput),
    namedtuples and dataclass instances. Everything else is a leaf."""
    if isinstance(x, dict):  # before dataclasses: HF ModelOutput is both
        for v in x.values():
            yield from tree_leaves(v)
    elif isinstance(x, (tuple, list)) and not isinstance(x, torch.Size):
        for v in x:
            yield from tree_leaves(v)
    elif _is_dataclass_instance(x):
        for f in dataclasses.fields(x):
            yield from tree_leaves(getattr(x, f.name))
    else:
        yield x


def tree_clone(x: Any) -> Any:
    """Copy a pytree, giving every tensor leaf fresh storage (detached, same ``requires_grad``).
    Non-tensor leaves are shared (they are usually constants or modules)."""
    if isinstance(x, torch.Tensor):
        out = x.detach().clone()
        if x.requires_grad:
            out.requires_grad_(True)
        return out
    if isinstance(x, dict):
        try:
            return type(x)((k, tree_clone(v)) for k, v in x.items())
        except TypeError:
            return {k: tree_clone(v) for k, v in x.items()}
    if _is_namedtuple(x):
        return type(x)(*(tree_clone(v) for v in x))
    if isinstance(x, (tuple, list)) and not isinstance(x, torch.Size):
        return type(x)(tree_clone(v) for v in x)
    if _is_dataclass_instance(x):
        return dataclasses.replace(
            x, **{f.name: tree_clone(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
        )
    return x


# ----------------------------------------------------------------------------------- comparisons


def _tensor_close(actual: torch.Tensor, expected: torch.Tensor, path: str, **tol: Any) -> None:
    assert isinstance(actual, torch.Tensor), f"{path}: expected a tensor, got {type(actual).__name__}"
    assert type(actual) is type(expected), (
        f"{path}: tensor type {type(actual).__name__} != {type(expected).__name__}"
    )
    assert actual.requires_grad == expected.requires_grad, (
        f"{path}: requires_grad {actual.requires_grad} != {expected.requires_grad}"
    )
    torch.testing.assert_close(actual.detach(), expected.detach(), msg=lambda m: f"{path}: {m}", **tol)


def tree_assert_close(
    actual: Any, expected: Any, path: str = "out", check_requires_grad: bool = True, **tol: Any
) -> None:
    """Assert two pytrees are equal in structure and close in values.

    Tensors: ``torch.testing.assert_close`` (shape, dtype, device checked; ``rtol``/``atol`` from
    ``tol``) plus equal ``requires_grad`` unless ``check_requires_grad=False``. Tuples/lists: same type
    and length. Dicts: same type and keys (order included). Dataclasses: same type, fields compared.
    Anything else (None, numbers, strings, dtypes, ...): same type and ``==``.
    """
    if isinstance(expected, torch.Tensor):
        if check_requires_grad:
            _tensor_close(actual, expected, path, **tol)
        else:
            assert isinstance(actual, torch.Tensor), f"{path}: expected a tensor, got {type(actual).__name__}"
            torch.testing.assert_close(
                actual.detach(), expected.detach(), msg=lambda m: f"{path}: {m}", **tol
            )
        return
    assert type(actual) is type(expected), (
        f"{path}: type {type(actual).__name__} != expected {type(expected).__name__} "
        f"(actual={_short(actual)}, expected={_short(expected)})"
    )
    kw = {"check_requires_grad": check_requires_grad, **tol}
    if isinstance(expected, dict):
        assert list(actual.keys()) == list(expected.keys()), (
            f"{path}: keys {list(actual.keys())} != {list(expected.keys())}"
        )
        for k in expected:
            tree_assert_close(actual[k], expected[k], f"{path}[{k!r}]", **kw)
    elif isinstance(expected, (tuple, list)) and not isinstance(expected, torch.Size):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            tree_assert_close(a, e, f"{path}[{i}]", **kw)
    elif _is_dataclass_instance(expected):
        for f in dataclasses.fields(expected):
            tree_assert_close(getattr(actual, f.name), getattr(expected, f.name), f"{path}.{f.name}", **kw)
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _short(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor{tuple(x.shape)}:{x.dtype}"
    r = repr(x)
    return r if len(r) < 80 else r[:77] + "..."


# ------------------------------------------------------------------------------------- one call, recorded


def scalar_loss(out: Any) -> torch.Tensor:
    """Sum over the floating-point (and complex: by magnitude) tensor leaves that require grad of
    ``(t.float() ** 2).mean()``."""
    terms = [
        ((t.abs() if t.is_complex() else t).float() ** 2).mean()
        for t in tree_leaves(out)
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.requires_grad
    ]
    assert terms, "grad=True but no output is a float tensor that requires grad"
    return torch.stack(terms).sum()


def summed_loss(out: Any) -> torch.Tensor:
    """Sum of the float (complex: real part) tensor leaves that require grad: an upstream gradient of ones, as in
    PyTorch's own tests' ``out.sum().backward()``."""
    terms = [(t.real if t.is_complex() else t).float().sum() for t in tree_leaves(out)
             if isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())]
    assert terms, "grad=True but no output requires grad"
    return torch.stack(terms).sum()


def named_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}


def _named_params(modules: Any) -> list[tuple[str, nn.Parameter]]:
    """Parameters by name: one module's own names; several modules' as ``modules[j].name`` (each module once)."""
    mods = [m for i, m in enumerate(modules) if isinstance(m, nn.Module) and all(m is not o for o in modules[:i])]
    if len(mods) == 1:
        return list(mods[0].named_parameters())
    return [(f"modules[{j}].{n}", p) for j, m in enumerate(mods) for n, p in m.named_parameters()]


@dataclasses.dataclass
class Run:
    """What one call left behind: its output, its inputs after the call, the gradients (``parameter NAME`` and
    ``input leaf #i``, with ``grad``), the buffers of ``buffers_of`` and what ``world()`` returned."""

    out: Any
    inputs: Any
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    world: Any


def run(fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, *,
        params: list[tuple[str, nn.Parameter]] = (), grad: bool = False,
        loss: Callable[[Any], torch.Tensor] = scalar_loss, buffers_of: nn.Module | None = None,
        reset: Callable[[], None] | None = None, world: Callable[[], Any] | None = None) -> Run:
    """Call ``fn`` on fresh clones of ``args``/``kwargs`` (after ``reset()``, with the ``params``' grads cleared);
    with ``grad``, backpropagate ``loss`` of the output and record the gradients."""
    if reset is not None:
        reset()
    for _, p in params:
        p.grad = None
    a, k = tree_clone(args), tree_clone(kwargs or {})
    out = fn(*a, **k)
    grads: dict[str, torch.Tensor | None] = {}
    if grad:
        loss(out).backward()
        grads = {f"parameter {n}": None if p.grad is None else p.grad.detach().clone() for n, p in params}
        for i, t in enumerate(tree_leaves((a, k))):
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf:
                grads[f"input leaf #{i}"] = None if t.grad is None else t.grad.detach().clone()
    buffers = {} if buffers_of is None else {n: b.detach().clone() for n, b in buffers_of.named_buffers()}
    return Run(out, (a, k), grads, buffers, None if world is None else world())


def assert_same(actual: Run, expected: Run, what: str = "call", *, python_inputs: bool = False, **tol: Any) -> None:
    """Outputs, the tensor inputs after the call (with ``python_inputs``, the whole input tree: containers the
    program mutates), gradients, buffers and world of ``actual`` equal ``expected``'s."""
    tree_assert_close(actual.out, expected.out, f"{what}: out", **tol)
    if python_inputs:
        tree_assert_close(actual.inputs, expected.inputs, f"{what}: inputs after the call", check_requires_grad=False,
                          **tol)
    else:
        for i, (a, e) in enumerate(zip(tree_leaves(actual.inputs), tree_leaves(expected.inputs))):
            if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor):
                torch.testing.assert_close(
                    a.detach(), e.detach(), msg=lambda m, i=i: f"{what}: input leaf #{i} after the call: {m}", **tol
                )
    assert list(actual.grads) == list(expected.grads), f"{what}: grads of {list(actual.grads)} != eager's"
    for name, e in expected.grads.items():
        a = actual.grads[name]
        assert (e is None) == (a is None), f"{what}: grad of {name}: eager {e is not None}, stampout {a is not None}"
        if e is not None:
            torch.testing.assert_close(a, e, msg=lambda m, n=name: f"{what}: grad of {n}: {m}", **tol)
    assert list(actual.buffers) == list(expected.buffers), f"{what}: buffers {list(actual.buffers)} != eager's"
    for name, e in expected.buffers.items():
        torch.testing.assert_close(actual.buffers[name], e, msg=lambda m, n=name: f"{what}: buffer {n}: {m}", **tol)
    if expected.world is not None and actual.world is not None:
        tree_assert_close(actual.world, expected.world, f"{what}: world after the call", check_requires_grad=False,
                          **tol)


# ---------------------------------------------------------------------------------------- the checks


def assert_matches_eager(
    model_or_fn: Callable[..., Any],
    *args: Any,
    grad: bool = False,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    check_buffers: bool = True,
    lint: bool = True,
    **kwargs: Any,
) -> stampout.Capture:
    """Capture ``model_or_fn(*args, **kwargs)`` with ``stampout.capture`` and check it against eager.

    * The eager reference runs on ``copy.deepcopy(model)`` (made *before* capturing, so it sees the
      same state the capture saw); the captured program runs on the original model's live parameters.
      For a plain function the same function is used for both runs.
    * Every run gets its own clone of the tensor inputs (``requires_grad`` kept), so in-place input
      mutation and input gradients are compared separately.
    * ``cap.gm.graph.lint()`` must pass; outputs must match in structure and value.
    * ``grad=True``: ``scalar_loss`` of both outputs is backpropagated; parameter ``.grad`` are
      compared by name (modules only) and so are the grads of leaf inputs with ``requires_grad``.
    * ``check_buffers``: buffers (e.g. BatchNorm running stats) must match after one call each.
    * Mutated tensor inputs must match after the call.

    ``grad``, ``rtol``, ``atol``, ``check_buffers`` and ``lint`` are reserved; every other keyword
    argument is passed to the program. Returns the ``Capture``.
    """
    is_module = isinstance(model_or_fn, nn.Module)
    if is_module:
        for p in model_or_fn.parameters():
            p.grad = None
    ref = copy.deepcopy(model_or_fn) if is_module else model_or_fn

    cap = stampout.capture(model_or_fn, *tree_clone(args), **tree_clone(kwargs))
    assert isinstance(cap.gm, torch.fx.GraphModule), f"cap.gm is {type(cap.gm).__name__}"
    if lint:
        cap.gm.graph.lint()

    def recorded(fn: Callable[..., Any], module: Any) -> Run:
        return run(fn, args, kwargs, params=_named_params([module]), grad=grad,
                   buffers_of=module if check_buffers and is_module else None)

    expected = recorded(ref, ref)
    actual = recorded(cap, model_or_fn)
    # (Python-level container mutation is a side effect of the capture itself, not of ``cap(...)``: only tensor
    # inputs are compared after the call.)
    assert_same(actual, expected, "capture", rtol=rtol, atol=atol)
    return cap


def traced(cap: stampout.Capture) -> int:
    """Region bodies traced, deduped ones included (what PyTorch's `speculate_subgraph` counter counts)."""
    return cap.stats.traces + cap.stats.dedups


def check(
    fn: Callable,
    *args: Any,
    traces: int | None = None,
    reuses: int | None = None,
    grad: bool = False,
    reset: Callable[[], None] | None = None,
    world: Callable[[], Any] | None = None,
    modules: Any = (),
    backend: Any = "eager",
    calls: int = 2,
    dynamic: bool | None = None,
    capture: bool = True,
    loss: Callable[[Any], torch.Tensor] = summed_loss,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **kwargs: Any,
) -> stampout.Capture | None:
    """Run ``fn`` three ways on fresh clones of the inputs — eager, ``stampout.capture`` then the Capture, and
    ``stampout.compile`` for ``calls`` calls — all on the live objects (no copy), and assert each equals eager:
    outputs, the whole input tree after the call, gradients (of ``loss``, ``summed_loss`` unless given) of leaf
    inputs and of the parameters of ``fn`` (a module), of ``modules`` and of modules among the inputs, and
    ``world()`` after every run. ``reset()`` puts the world back before each run, so the program's own Python side
    effects happen once per run, as in eager.

    Counts: PyTorch counts traced region bodies (``speculate_subgraph`` calls), a deduped trace included; here that
    is ``traced(cap)``, and ``reuses`` is the number of stamped-out calls. ``capture=False``: a program ``capture``
    refuses (data-dependent Python): only ``compile``, which runs that part eagerly, is checked. Returns the
    Capture for more assertions."""
    tol = {"rtol": rtol, "atol": atol}
    mods = [fn, *modules, *(leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, nn.Module))]
    params = _named_params(mods)
    expected = run(fn, args, kwargs, params=params, grad=grad, loss=loss, reset=reset, world=world)

    cap = None
    if capture:
        holder: list[stampout.Capture] = []
        # The capture runs the program's Python once, for real: the world after it is eager's after one call.
        run(lambda *a, **k: holder.append(stampout.capture(fn, *a, **k)), args, kwargs, reset=reset)
        cap = holder[0]
        cap.gm.graph.lint()
        if world is not None and not any(isinstance(t, torch.Tensor) for t in tree_leaves(expected.world)):
            # (Python state only: the capture runs no tensor op for real and puts the generators back)
            tree_assert_close(world(), expected.world, "world after capture", check_requires_grad=False, **tol)
        if traces is not None:
            assert traced(cap) == traces, f"traced {traced(cap)} region bodies, expected {traces}: {cap.stats}"
        if reuses is not None:
            assert cap.stats.reuses == reuses, f"reused {cap.stats.reuses}, expected {reuses}: {cap.stats}"
        actual = run(cap, args, kwargs, params=params, grad=grad, loss=loss, reset=reset)
        assert_same(actual, expected, "capture", python_inputs=True, **tol)

    compiled = stampout.compile(fn, backend=backend, dynamic=dynamic) if calls else None
    for i in range(calls):
        actual = run(compiled, args, kwargs, params=params, grad=grad, loss=loss, reset=reset, world=world)
        assert_same(actual, expected, f"compiled call {i}", python_inputs=True, **tol)
    return cap


def check_capture(fn: Callable[..., Any], *args: Any, grad: bool = True, params_of: Any = None) -> stampout.Capture:
    """Eager on ``fn`` itself (no copy: per-instance patches and closures stay as they are), then capture and run
    the capture on the same live state: ``check(..., calls=0)`` with the parameters of ``params_of`` (default:
    ``fn``), ``scalar_loss`` and ``TOL``."""
    modules = [] if params_of is None else [params_of]
    cap = check(fn, *args, grad=grad, modules=modules, calls=0, loss=scalar_loss, **TOL)
    assert cap is not None
    return cap


def check_call(eager: Callable[..., Any], compiled: Callable[..., Any], *args: Any, grad: bool = True,
               params_of: Any = None, compiled_params_of: Any = None, what: str = "call", **tol: Any) -> None:
    """One compiled call against eager on the same (current) state: outputs, tensor inputs after the call, and
    with ``grad`` the gradients of ``params_of``'s parameters (default: ``eager``'s) and of leaf inputs. A compiled
    copy of the eager model: its parameters are ``compiled_params_of``'s. ``tol``: ``TOL`` unless given (``rtol=None,
    atol=None``: ``torch.testing.assert_close``'s defaults)."""
    params = _named_params([params_of if params_of is not None else eager])
    compiled_params = params if compiled_params_of is None else _named_params([compiled_params_of])
    expected = run(eager, args, params=params, grad=grad)
    actual = run(compiled, args, params=compiled_params, grad=grad)
    assert_same(actual, expected, what, **(tol or TOL))


def same(compiled: Callable[..., Any], eager: Callable[..., Any], *args: Any) -> None:
    """``compiled(*args)`` equals ``eager(*args)`` on fresh clones of ``args``: ``check_call`` without gradients,
    at ``torch.testing.assert_close``'s default tolerances."""
    check_call(eager, compiled, *args, grad=False, rtol=None, atol=None)
