"""One differential check for PyTorch's own reuse tests re-expressed against stampout (test_reuse_pytorch*.py).

`check(fn, *args, traces=..)` runs `fn` three ways on fresh clones of the inputs — eager, `stampout.capture`
then the Capture, and `stampout.compile` for `calls` calls — and asserts each equals eager: outputs, the
inputs after the call (in-place mutation), gradients of leaf inputs and of the parameters of `modules`, and
`world()` (whatever the test says the program changes outside its inputs) after every run. `reset()` puts
the world back before each run, so the program's own Python side effects happen once per run, as in eager.

Counts: PyTorch counts traced region bodies (`speculate_subgraph` calls), a deduped trace included; here that
is `cap.stats.traces + cap.stats.dedups`, and `reuses` is the number of stamped-out calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from helpers import tree_assert_close, tree_clone, tree_leaves
from torch import nn

import stampout

__all__ = ["check", "traced"]


def traced(cap: stampout.Capture) -> int:
    """Region bodies traced, deduped ones included (what PyTorch's `speculate_subgraph` counter counts)."""
    return cap.stats.traces + cap.stats.dedups


def _loss(out: Any) -> torch.Tensor:
    terms = [t.float().sum() for t in tree_leaves(out)
             if isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())]
    assert terms, "grad=True but no output requires grad"
    total = torch.stack([t.real if t.is_complex() else t for t in terms]).sum()
    return total


def _modules(fn: Any, args: Any, modules: Sequence[nn.Module]) -> list[nn.Module]:
    found = list(modules)
    if isinstance(fn, nn.Module):
        found.append(fn)
    found += [leaf for leaf in tree_leaves(args) if isinstance(leaf, nn.Module)]
    return found


def _grads(args: Any, modules: list[nn.Module]) -> list[Any]:
    leaves = [t.grad for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
    params = [p.grad for m in modules for p in m.parameters()]
    return [None if g is None else g.detach().clone() for g in leaves + params]


def _zero(modules: list[nn.Module]) -> None:
    for m in modules:
        for p in m.parameters():
            p.grad = None


def _run(runner: Callable, args: tuple, kwargs: dict, reset: Callable | None, world: Callable | None,
         grad: bool, modules: list[nn.Module]) -> tuple[Any, Any, Any, Any]:
    if reset is not None:
        reset()
    _zero(modules)
    a, k = tree_clone(args), tree_clone(kwargs)
    out = runner(*a, **k)
    grads = None
    if grad:
        _loss(out).backward()
        grads = _grads((a, k), modules)
    return out, (a, k), grads, (None if world is None else world())


def _same(actual: tuple, expected: tuple, what: str, tol: dict) -> None:
    out, inputs, grads, world = actual
    e_out, e_inputs, e_grads, e_world = expected
    tree_assert_close(out, e_out, f"{what} out", **tol)
    tree_assert_close(inputs, e_inputs, f"{what} inputs after the call", check_requires_grad=False, **tol)
    if e_grads is not None:
        assert len(grads) == len(e_grads)
        for i, (g, e) in enumerate(zip(grads, e_grads)):
            if e is None or g is None:
                assert e is None and g is None, f"{what} grad #{i}: eager {e is not None}, stampout {g is not None}"
            else:
                torch.testing.assert_close(g, e, msg=lambda m, i=i: f"{what} grad #{i}: {m}", **tol)
    if e_world is not None and world is not None:
        tree_assert_close(world, e_world, f"{what} world after the call", check_requires_grad=False, **tol)


def check(
    fn: Callable,
    *args: Any,
    traces: int | None = None,
    reuses: int | None = None,
    grad: bool = False,
    reset: Callable[[], None] | None = None,
    world: Callable[[], Any] | None = None,
    modules: Sequence[nn.Module] = (),
    backend: Any = "eager",
    calls: int = 2,
    dynamic: bool | None = None,
    capture: bool = True,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **kwargs: Any,
) -> stampout.Capture | None:
    """Eager vs capture vs compile (see the module docstring); returns the Capture for more assertions.
    `capture=False`: a program `capture` refuses (data-dependent Python): only `compile`, which runs that part
    eagerly, is checked."""
    tol = {"rtol": rtol, "atol": atol}
    mods = _modules(fn, (args, kwargs), modules)
    expected = _run(fn, args, kwargs, reset, world, grad, mods)

    holder: list[stampout.Capture] = []
    if not capture:
        _compiled_calls(fn, args, kwargs, expected, reset, world, grad, mods, backend, dynamic, calls, tol)
        return None

    def capture_and_run(*a: Any, **k: Any) -> Any:
        holder.append(stampout.capture(fn, *a, **k))

    # The capture runs the program's Python once, for real: the world after it is eager's after one call.
    _run(capture_and_run, args, kwargs, reset, None, False, mods)
    cap = holder[0]
    cap.gm.graph.lint()
    if world is not None and not any(isinstance(t, torch.Tensor) for t in tree_leaves(expected[3])):
        # (Python state only: the capture runs no tensor op for real and puts the generators back)
        tree_assert_close(world(), expected[3], "world after capture", check_requires_grad=False, **tol)
    if traces is not None:
        assert traced(cap) == traces, f"traced {traced(cap)} region bodies, expected {traces}: {cap.stats}"
    if reuses is not None:
        assert cap.stats.reuses == reuses, f"reused {cap.stats.reuses}, expected {reuses}: {cap.stats}"
    _same(_run(cap, args, kwargs, reset, None, grad, mods), expected, "capture", tol)

    _compiled_calls(fn, args, kwargs, expected, reset, world, grad, mods, backend, dynamic, calls, tol)
    return cap


def _compiled_calls(fn, args, kwargs, expected, reset, world, grad, mods, backend, dynamic, calls, tol) -> None:
    compiled = stampout.compile(fn, backend=backend, dynamic=dynamic)
    for i in range(calls):
        _same(_run(compiled, args, kwargs, reset, world, grad, mods), expected, f"compiled call {i}", tol)
