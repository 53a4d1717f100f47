"""Test helpers: compare a stampout capture against eager PyTorch. Usage:

from helpers import assert_matches_eager, tree_assert_close   # or: from tests.helpers import ...

cap = assert_matches_eager(model, x, grad=True)
assert cap.stats.traces == 1
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import stampout

__all__ = [
    "TOL",
    "assert_matches_eager",
    "check_call",
    "check_capture",
    "named_grads",
    "scalar_loss",
    "tree_assert_close",
    "tree_clone",
    "tree_leaves",
]


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


# ------------------------------------------------------------------------------------- gradients


def scalar_loss(out: Any) -> torch.Tensor:
    """Sum over all floating-point tensor leaves of ``(t.float() ** 2).mean()``."""
    terms = [
        (t.float() ** 2).mean()
        for t in tree_leaves(out)
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.requires_grad
    ]
    assert terms, "grad=True but no output is a float tensor that requires grad"
    return torch.stack(terms).sum()


def named_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}


def _input_grads(args: Any) -> list[tuple[int, torch.Tensor | None]]:
    return [
        (i, None if t.grad is None else t.grad.detach().clone())
        for i, t in enumerate(tree_leaves(args))
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf
    ]


def _zero_grads(model: Any) -> None:
    if isinstance(model, nn.Module):
        for p in model.parameters():
            p.grad = None


# ---------------------------------------------------------------------------------------- main


def assert_matches_eager(
    model_or_fn: Callable[..., Any],
    *args: Any,
    grad: bool = False,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    check_buffers: bool = True,
    lint: bool = True,
    **kwargs: Any,
):
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
    tol = {"rtol": rtol, "atol": atol}
    is_module = isinstance(model_or_fn, nn.Module)
    _zero_grads(model_or_fn)
    ref = copy.deepcopy(model_or_fn) if is_module else model_or_fn

    capture_args, capture_kwargs = tree_clone(args), tree_clone(kwargs)
    cap = stampout.capture(model_or_fn, *capture_args, **capture_kwargs)
    assert isinstance(cap.gm, torch.fx.GraphModule), f"cap.gm is {type(cap.gm).__name__}"
    if lint:
        cap.gm.graph.lint()

    eager_args, eager_kwargs = tree_clone(args), tree_clone(kwargs)
    cap_args, cap_kwargs = tree_clone(args), tree_clone(kwargs)

    _zero_grads(ref)
    expected = ref(*eager_args, **eager_kwargs)
    _zero_grads(model_or_fn)
    actual = cap(*cap_args, **cap_kwargs)

    tree_assert_close(actual, expected, "out", **tol)
    # In-place mutation of tensor inputs must match (Python-level container mutation is a side effect
    # of the capture itself, not of ``cap(...)``, so only tensor leaves are compared).
    for i, (a, e) in enumerate(
        zip(tree_leaves((cap_args, cap_kwargs)), tree_leaves((eager_args, eager_kwargs)))
    ):
        if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor):
            torch.testing.assert_close(
                a.detach(), e.detach(), msg=lambda m, i=i: f"input leaf #{i} after call: {m}", **tol
            )

    if check_buffers and is_module:
        cap_bufs = dict(model_or_fn.named_buffers())
        ref_bufs = dict(ref.named_buffers())
        assert list(cap_bufs) == list(ref_bufs), f"buffers {list(cap_bufs)} != {list(ref_bufs)}"
        for name, ref_buf in ref_bufs.items():
            torch.testing.assert_close(
                cap_bufs[name], ref_buf, msg=lambda m, name=name: f"buffer {name}: {m}", **tol
            )

    if grad:
        scalar_loss(expected).backward()
        scalar_loss(actual).backward()
        if is_module:
            exp_g, act_g = named_grads(ref), named_grads(model_or_fn)
            assert list(act_g) == list(exp_g)
            for name in exp_g:
                e, a = exp_g[name], act_g[name]
                if e is None or a is None:
                    assert e is None and a is None, (
                        f"grad of parameter {name}: eager {'None' if e is None else 'set'}, "
                        f"captured {'None' if a is None else 'set'}"
                    )
                    continue
                torch.testing.assert_close(
                    a, e, msg=lambda m, name=name: f"grad of parameter {name}: {m}", **tol
                )
        exp_in = _input_grads((eager_args, eager_kwargs))
        act_in = _input_grads((cap_args, cap_kwargs))
        assert [i for i, _ in act_in] == [i for i, _ in exp_in]
        for (i, e), (_, a) in zip(exp_in, act_in):
            if e is None or a is None:
                assert e is None and a is None, (
                    f"grad of input leaf #{i}: eager {e is not None}, captured {a is not None}"
                )
                continue
            torch.testing.assert_close(a, e, msg=lambda m, i=i: f"grad of input leaf #{i}: {m}", **tol)
    return cap


# ------------------------------------------------------------------------- live state, no copy

TOL = {"rtol": 1e-4, "atol": 1e-5}


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
