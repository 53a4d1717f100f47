"""A new size's C++ compile in the background: the call that made a dimension symbolic does not wait for it.

After a compiled function has run at one sequence length, the first call at another captures again with that
dimension symbolic (compile/automatic_dynamic.py), and Inductor compiles the symbolic graph: AOTAutograd and
lowering (Python, ~2 s for a decoder layer on 2 cores), then the C++ compiler (~3 s CPU, 3-6 s wall: one C++
module per distinct region), which was a third to a half of the first call. The lowering still runs on the calling
thread, inside the call, as every compile does (it flips process-wide torch state, such as anomaly mode during
AOTAutograd's tracing, that other threads and the guards would see), and so Inductor's size assumptions are in
the ShapeEnv before the caller makes the capture's guards. What goes to the background is only what
pipeline.overlapped() already defers: the compiler runs, on Inductor's pool, and the waits and module loads
after them (`pipeline.overlapped(finish_later)`), on a thread of their own. Until those are done, calls run the
captured graph eagerly (the eager backend's runner: each region's subgraph called as a module), as torch's own
asynchronous compile mode (Inductor's `fx_compile_mode="async+subprocess"`) runs the graph eagerly until its
compile is done; the compiled program serves from the first call after. A build or load that fails leaves the
eager runner in place (a warning says so).

What goes this way (`deferrable`): an inference graph (no input requires grad with grad on) compiled inside
`recompiling()`, which compile/function.py opens only when the function already holds a compiled program (a
recapture, not a first call: a first call, `dynamic=True`'s symbolic one too, compiles at once):
- with symbolic sizes (`config.background_recompile`) and with static sizes (`config.overlap_builds`) alike, calls
  run the captured graph eagerly until the build is done, as above (EAGER). In a generate with a static cache the
  decode step is such a recapture: its build (~10 s of C++ on 2 cores) no longer stalls the first generate's second
  step; the steps run eagerly until it is done (a few ms each), and the first generate ends meanwhile. With a
  dynamic cache the first decode step's static capture, called once per generate, overlaps the next step's
  symbolic capture and lowering.
A first compile is deferred only with `config.overlap_first_build` (off: a first call returns compiled, and cold
first-call figures stay the compile's cost), the other way (WAIT): its capturing call runs the graph eagerly, and
the entry's next call waits for the build (it never runs eagerly again). In a generate, the prefill's build would
then overlap the first decode step's capture and lowering.
`wait_all()` waits for every such compile (benchmarks: when the compiled program is ready); the thread is not a
daemon, so a process that exits meanwhile finishes it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.fx as fx

from .. import config
from . import split
from .runner import as_call_modules

log = logging.getLogger("stampout.backends")

_local = threading.local()  # .allowed: inside recompiling() on this thread (True: a recapture; False: a first compile)
_started: list[Deferred] = []  # compiles still finishing (each removes itself when done)
# This process: compiles whose C++ half went to the background, that finished and serve calls, that failed.
STATS = {"deferred": 0, "ready": 0, "failed": 0}


EAGER = "eager"  # calls run eagerly until the build is done (a recapture)
WAIT = "wait"  # the capturing call runs eagerly; later calls wait for the build (a first compile, if deferred)


@contextlib.contextmanager
def recompiling(allowed: bool) -> Iterator[None]:
    """Inside (when `allowed`, a recapture): an inference graph this thread hands Inductor finishes its compile in
    the background, where the switch for its kind is on (see the module docstring); otherwise (a first compile)
    only with `config.overlap_first_build`, its next call waiting for the build."""
    outer = getattr(_local, "allowed", None)
    _local.allowed = allowed
    try:
        yield
    finally:
        _local.allowed = outer


def deferrable(example_inputs: list[Any]) -> str | None:
    """How a graph this thread compiles now finishes (EAGER, WAIT), or None: at once."""
    allowed = getattr(_local, "allowed", None)
    if allowed is None or split.trains(example_inputs):
        return None
    if not allowed:
        return WAIT if config.overlap_first_build else None
    if split.symbolic(example_inputs):
        return EAGER if config.background_recompile else None
    return EAGER if config.overlap_builds else None


def eager_runner(gm: fx.GraphModule) -> Callable[..., Any]:
    """`gm` run eagerly (a copy: the compile may change gm)."""
    return as_call_modules(gm)


class Deferred:
    """A compiled program whose C++ builds and module loads (`finish`) run on a thread; until they are done, calls
    run `eager`."""

    def __init__(self, eager: Callable[..., Any], compiled: Callable[..., Any],
                 finish: list[Callable[[], Any]], what: str, mode: str = EAGER) -> None:
        self._eager, self._compiled, self._finish, self.what = eager, compiled, list(finish), what
        self._run: Callable[..., Any] | None = None  # the compiled program, once ready
        self._waits = mode == WAIT  # (after its first call, each call waits for the build)
        self._called = False
        self.error: BaseException | None = None
        STATS["deferred"] += 1
        self._thread = threading.Thread(target=self._finish_now, name="stampout-c++", daemon=False)
        _started.append(self)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the compile; whether the compiled program serves calls now."""
        self._thread.join(timeout)
        return self._run is not None

    def __call__(self, *args: Any) -> Any:
        run = self._run
        if run is None and self._waits:
            if self._called:
                self._thread.join()
                run = self._run  # (None where the build failed: eager)
            self._called = True
        return run(*args) if run is not None else self._eager(*args)

    def _finish_now(self) -> None:
        try:
            for finish in self._finish:
                finish()
        except Exception as error:  # noqa: BLE001 - the eager runner stays: right, only slower
            self.error = error
            STATS["failed"] += 1
            log.warning("inductor: building the %s in the background failed (%s: %s); it runs eagerly", self.what,
                        type(error).__name__, (str(error).splitlines() or [""])[0][:200])
        else:
            STATS["ready"] += 1
            self._run = self._compiled
            log.info("inductor: the %s compiled in the background serves calls from now on", self.what)
        finally:
            self._finish = []
            with contextlib.suppress(ValueError):
                _started.remove(self)


def wait_all(timeout: float | None = None) -> None:
    """Wait for every background compile started so far."""
    for deferred in list(_started):
        deferred.wait(timeout)
