"""The public entry points: capture(), explain(), reset(). (`compile` is in compiled.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .capture import Capture
from .capturing import capture_program
from .compile_args import check_call, check_callable
from .errors import CaptureError
from .piecewise import explain_break
from .sharded_capture import Boundaries, sharded_modules


def capture(fn: Callable, *args: Any, **kwargs: Any) -> Capture:
    """Capture `fn(*args, **kwargs)` into a `torch.fx.GraphModule`, stamping out repeated regions.

    Example::

        cap = stampout.capture(model, torch.randn(2, 16))
        print(cap.gm.code)        # the graph: inputs, then parameters as placeholders
        y = cap(torch.randn(2, 16))

    Args:
        fn: an `nn.Module` or any callable that runs torch code.
        *args, **kwargs: example inputs; tensors become graph inputs, everything else is baked in.

    Returns:
        A `Capture`: `.gm`, `.stats`, `.events`, `.explain()`, callable like `fn`.

    Raises:
        CaptureError: the program needs tensor values in Python (`if t.sum() > 0`, `.item()`).
    """
    check_callable(fn, "capture")
    check_call(fn, args, kwargs, "capture")
    if sharded_modules(fn):  # FSDP2: each sharded module's hooks are nodes around its forward
        boundaries = Boundaries(fn)
        return capture_program(fn, args, kwargs, body=lambda *a, **k: boundaries.run(fn, a, k), sharded=True)
    return capture_program(fn, args, kwargs)


def explain(fn: Callable, *args: Any, **kwargs: Any) -> str:
    """Capture `fn(*args, **kwargs)` and return the per-region-call report; nothing is compiled. A program
    that cannot be captured gets where it breaks and why, and what `stampout.compile` runs eagerly."""
    try:
        cap = capture(fn, *args, **kwargs)
    except CaptureError as error:
        return explain_break(fn, error)
    return cap.explain()


def reset() -> None:
    """Drop every cache stampout keeps: each compiled function's entries, and every memo cache registered in
    `stampout.caches` (compiled functions keep theirs until reset)."""
    from . import caches
    from .compiled import reset_all

    reset_all()
    caches.clear_all()


__all__ = ["capture", "explain", "reset"]
