"""A new size's Inductor compile on a thread: the call that made a dimension symbolic does not wait for it.

After a compiled function has run at one sequence length, the first call at another captures again with that
dimension symbolic (compile/automatic_dynamic.py), and Inductor compiles the symbolic graph: lowering, then one
C++ module per distinct region, about half of what the first call's compile cost (2 cores: the C++ compiler
alone is 3 s CPU for one decoder layer, the first compile ~9 s). As torch's own asynchronous compile mode
(Inductor's `fx_compile_mode="async"`) does, the calls that arrive meanwhile run the captured graph eagerly (the
eager backend's runner: each region's subgraph called as a module), and the compiled program takes over from the
first call after the compile finished. The first new length then costs its capture and an eager run.

What goes this way (`deferrable`): an inference graph (no input requires grad with grad on) with symbolic sizes,
compiled inside `recompiling()`, which compile/function.py opens only when the function already holds a compiled
program (a recapture, not a first call: `dynamic=True` compiles its first, symbolic, capture at once) and with
`config.background_recompile` on. The compile starts once the caller has generated the capture's guards from the
ShapeEnv (`start`), so the two threads never use one ShapeEnv at once; guards Inductor adds while it compiles
(its size assumptions) are checked on every call of the compiled program, and a call outside them runs eagerly —
so the compiled program serves only sizes it was compiled for. A compile that fails leaves the eager runner in
place (a warning says so). One Inductor compile runs at a time (`_COMPILING`): a compile on the calling thread
waits for the one in the background (Inductor's config patches are process-wide). `wait_all()` waits for every
compile started (benchmarks: when the compiled program is ready); the thread is not a daemon, so a process that
exits meanwhile finishes the compile (its caches stay whole).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from .. import config
from . import split
from .runner import as_call_modules

log = logging.getLogger("stampout.backends")

_local = threading.local()  # .pending: the Deferred compiles of the recapture in progress on this thread, or None
_COMPILING = threading.RLock()  # held by every Inductor compile of stampout's, on any thread
_started: list[Deferred] = []  # compiles started and not yet waited for (wait_all)
# This process: compiles deferred, finished and swapped in, finished with guards of their own, failed.
STATS = {"deferred": 0, "ready": 0, "guarded": 0, "failed": 0}


@contextlib.contextmanager
def recompiling(allowed: bool) -> Iterator[list[Deferred]]:
    """Inside: a symbolic inference graph this thread hands Inductor is compiled in the background (when `allowed`
    and the switch is on). Yields the list of such compiles, to `start` once the capture's guards are made."""
    outer = getattr(_local, "pending", None)
    pending: list[Deferred] = []
    _local.pending = pending if allowed and config.background_recompile else None
    try:
        yield pending
    finally:
        _local.pending = outer


def deferrable(example_inputs: list[Any]) -> bool:
    return (getattr(_local, "pending", None) is not None and split.symbolic(example_inputs)
            and not split.trains(example_inputs))


def compiling() -> Any:
    """The lock every Inductor compile holds (one at a time, on any thread)."""
    return _COMPILING


class Deferred:
    """A compile on a thread; until it is done, calls run `gm` eagerly."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any], compile_fn: Callable[[], Callable[..., Any]],
                 what: str) -> None:
        self._eager = as_call_modules(gm)  # (a copy: the compile may change gm)
        self._examples, self._compile, self.what = list(example_inputs), compile_fn, what
        self._grad = torch.is_grad_enabled()
        self._run: Callable[..., Any] | None = None  # the compiled program, once ready
        self._check: Callable[[list[Any]], bool] | None = None  # guards the compile added, if any
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        STATS["deferred"] += 1
        _local.pending.append(self)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._compile_now, name="stampout-recompile", daemon=False)
            _started.append(self)
            self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the compile; whether the compiled program serves calls now."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._run is not None

    def __call__(self, *args: Any) -> Any:
        run = self._run
        if run is not None and (self._check is None or self._check(list(args))):
            return run(*args)
        return self._eager(*args)

    def _compile_now(self) -> None:
        env = _shape_env(self._examples)
        try:
            with _COMPILING, torch.set_grad_enabled(self._grad):
                before = len(env.guards) if env is not None else 0
                compiled = self._compile()
                if env is not None and len(env.guards) > before:  # Inductor's own size assumptions
                    self._check = _guards_check(env, self._examples)
                    STATS["guarded"] += 1
        except Exception as error:  # noqa: BLE001 - the eager runner stays: right, only slower
            self.error = error
            STATS["failed"] += 1
            log.warning("inductor: compiling the %s in the background failed (%s: %s); it runs eagerly", self.what,
                        type(error).__name__, (str(error).splitlines() or [""])[0][:200])
            return
        STATS["ready"] += 1
        self._run = compiled
        log.info("inductor: the %s compiled in the background serves calls from now on", self.what)


def wait_all(timeout: float | None = None) -> None:
    """Wait for every background compile started so far."""
    while _started:
        _started.pop(0).wait(timeout)


def _shape_env(example_inputs: list[Any]) -> Any:
    from ..torch_internals import detect_fake_mode

    mode = detect_fake_mode(example_inputs)
    return getattr(mode, "shape_env", None)


def _guards_check(env: Any, example_inputs: list[Any]) -> Callable[[list[Any]], bool]:
    """Every guard the ShapeEnv holds now, over the graph's inputs (their values: tensors and ints)."""
    code = env.produce_guards_expression(example_inputs, ignore_static=False)
    if code is None:
        return lambda values: True
    return lambda values: bool(env.evaluate_guards_expression(code, values))
