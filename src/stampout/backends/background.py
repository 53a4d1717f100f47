"""A new size's C++ compile in the background: the call that made a dimension symbolic does not wait for it.

After a compiled function has run at one sequence length, the first call at another captures again with that
dimension symbolic (compile/automatic_dynamic.py), and Inductor compiles the symbolic graph: AOTAutograd and
lowering (Python, ~2 s for a decoder layer on 2 cores), then the C++ compiler (~3 s CPU, 3-6 s wall: one C++
module per distinct region), which was a third to a half of the first call. A symbolic graph's lowering goes to
the thread as well (`Lowering`; see Note: a symbolic graph's lowering in the background, for how its guards and
torch's process-wide state stay right). Any other lowering runs on the calling thread, inside the call, as every
compile does, so Inductor's size assumptions are in the ShapeEnv before the caller makes the capture's guards;
what goes to the background there is only what
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

import torch
import torch.fx as fx

from .. import config
from ..context import CAPTURE_LOCK
from ..torch_internals import dispatch_modes, function_modes, global_flags, patch_permanently
from ..trace.shapes import guard_clauses, guards_expression
from . import split
from .runner import as_call_modules

log = logging.getLogger("stampout.backends")

_local = threading.local()  # .allowed: inside recompiling() on this thread (True: a recapture; False: a first compile);
# .lowering: this thread lowers a symbolic graph in the background (Lowering)
_started: list[Deferred] = []  # compiles still finishing (each removes itself when done)
# This process: compiles whose C++ half went to the background, that finished and serve calls, that failed.
STATS = {"deferred": 0, "ready": 0, "failed": 0}
# Of those, symbolic graphs lowered there too, and those whose lowering assumed more about the sizes (Lowering).
LOWERING_STATS = {"lowered": 0, "assumed_more": 0}


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
                 finish: list[Callable[[], Any]], what: str, mode: str = EAGER, start: bool = True) -> None:
        self._eager, self._compiled, self._finish, self.what = eager, compiled, list(finish), what
        self._run: Callable[..., Any] | None = None  # the compiled program, once ready
        self._waits = mode == WAIT  # (after its first call, each call waits for the build)
        self._called = False
        self.error: BaseException | None = None
        STATS["deferred"] += 1
        self._thread = threading.Thread(target=self._finish_now, name="stampout-c++", daemon=False)
        _started.append(self)
        if start:
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


# Note: a symbolic graph's lowering in the background
# A new size's symbolic recapture (EAGER above) hands its AOTAutograd and lowering to the thread too, not only its
# C++ builds (`Lowering`): the calling thread captures, and its calls run the captured graph eagerly, which is right
# for every size the capture's guards admit. Four things make that sound:
# - The thread starts at the graph's first call, after the caller has made the entry's shape guards from the
#   ShapeEnv, so nothing on the calling thread reads the ShapeEnv while the lowering adds to it.
# - Lowering may assume more about the sizes than the capture did (Inductor's guards, added to the ShapeEnv after the
#   capture). What the ShapeEnv assumes about the graph's symbolic inputs is compared before and after the lowering
#   (`_Assumptions`); where it grew, the compiled program serves only the calls that meet the new assumptions, and the
#   others keep running eagerly (`admits`), until the caller's guards take the new assumptions in (`assumed_more`,
#   set by compile/function.py: the entry's shape guards made again, so a size outside them captures again).
# - Lowering changes process-wide state (Inductor's and functorch's config patches, fx's node-meta globals) and
#   captures patch process-wide torch hooks: the thread lowers holding CAPTURE_LOCK, which captures hold, and so does
#   every compile of `compile_graph` (one lowering at a time, as on one thread), and torch.compile's own lock (a
#   torch.compile of another function on the calling thread meanwhile would lower under these config patches, and
#   patch the config under this lowering). It runs with the caller's grad mode
#   and Inductor settings (mode=/options= and `fallback_random`, patched around the caller's compile: undone by then);
#   the default dtype and torch's process-wide flags, which it cannot set for itself, are the caller's before and after
#   it, else no compiled program serves (AOTAutograd traces the graph again: `torch.ones(n)` takes the default dtype);
#   a caller under autocast, inference mode or a torch function or dispatch mode lowers on its own thread (`lowers_later`).
# - AOTAutograd and Inductor's codegen restore the global RNG state on exit (`preserve_rng_state`), which would rewind
#   the random draws the calling thread made meanwhile, and AOTAutograd traces with anomaly detection on, a
#   process-wide flag the calling thread's guards read (every call would miss and capture again) and its autograd
#   obeys: on the lowering thread they leave both alone (they trace fakes, which draw nothing; anomaly detection
#   there only adds stack traces to a backward's nodes, and an inference graph has none).


def lowers_later() -> bool:
    """Whether a symbolic graph compiled now on this thread may be lowered on another (its thread state is plain, and
    the Inductor settings make the lowering benchmark no kernel: autotuning draws its example inputs from torch's
    global generator, which the calling thread draws from meanwhile)."""
    return (config.background_lowering and not torch.is_inference_mode_enabled()
            and not any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))
            and not function_modes() and not dispatch_modes() and not _benchmarks())


_BENCHMARKS = ("max_autotune", "max_autotune_gemm", "max_autotune_pointwise", "coordinate_descent_tuning",
               "benchmark_kernel", "benchmark_fusion")


def _benchmarks() -> bool:
    from ..torch_internals import inductor_config

    return any(getattr(inductor_config, name, False) for name in _BENCHMARKS)


@contextlib.contextmanager
def lowering() -> Iterator[None]:
    """One lowering at a time in this process (see Note: a symbolic graph's lowering in the background)."""
    with CAPTURE_LOCK:
        yield


class _Assumptions:
    """What a ShapeEnv assumes about the symbolic inputs among a graph's example inputs, as guard code over those
    inputs; `grown()`: after a compile, a check over the compiled program's arguments where it assumes more, else None."""

    def __init__(self, examples: list[Any]) -> None:
        self.positions = [i for i, value in enumerate(examples) if split.symbolic([value])]
        self.inputs = [examples[i] for i in self.positions]
        self.shape_env = next((_shape_env(v) for v in self.inputs if _shape_env(v) is not None), None)
        self.before = self._code()

    def _code(self) -> str | None:
        if self.shape_env is None:
            return None
        return guards_expression(guard_clauses(self.shape_env, self.inputs))

    def grown(self) -> Callable[[tuple], bool] | None:
        after = self._code()
        if after == self.before:
            return None
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        code = compile(after, "<stampout lowering's shape guards>", "eval")
        positions, names = self.positions, [f"t{i}" for i in range(len(self.positions))]
        log.info("inductor: lowering the symbolic graph assumed more about its sizes (%s); calls outside that run "
                 "eagerly", after[:300])

        def admits(args: tuple) -> bool:
            return bool(eval(code, SYMPY_INTERP, {"L": {n: args[i] for n, i in zip(names, positions)}}))  # noqa: S307

        return admits


def _shape_env(value: Any) -> Any:
    if isinstance(value, torch.SymInt):
        return value.node.shape_env
    fake_mode = getattr(value, "fake_mode", None)
    return getattr(fake_mode, "shape_env", None)


class Lowering(Deferred):
    """A symbolic graph whose AOTAutograd and lowering (`lower(finish)`: the compiled program, its builds appended to
    `finish`) run on the thread as well, before its builds; the thread starts at its first call (or `wait`). Until
    it is done, and for calls outside what the lowering assumed (`admits`), calls run `eager`."""

    def __init__(self, eager: Callable[..., Any], lower: Callable[[list[Callable[[], Any]]], Callable[..., Any]],
                 examples: list[Any], what: str) -> None:
        from ..torch_internals import inductor_config

        self._lower, self._grad = lower, torch.is_grad_enabled()
        self._settings = inductor_config.get_config_copy()  # (mode=/options=, fallback_random: the caller's patches)
        self._torch_state = _torch_state()  # (process-wide: read by the lowering, not the caller's to keep)
        self._assumed = _Assumptions(examples)  # (on the calling thread, before anything lowers)
        self.admits: Callable[[tuple], bool] | None = None  # set before the compiled program serves
        self.assumed_more: Callable[[], Any] | None = None  # (the caller's: called on the thread where admits is set)
        self._begun = threading.Lock()
        super().__init__(eager, _unset, [], what, EAGER, start=False)

    def _begin(self) -> None:
        if self._thread.ident is None:
            with self._begun:
                if self._thread.ident is None:
                    self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        self._begin()
        return super().wait(timeout)

    def __call__(self, *args: Any) -> Any:
        run = self._run
        if run is None:  # (the thread starts after this call: torch's ops release the interpreter lock, and each
            try:  # took it back from the lowering's Python only at a switch interval: the first call ran ~3x slower)
                return self._eager(*args)
            finally:
                self._begin()
        admits = self.admits
        return run(*args) if admits is None or admits(args) else self._eager(*args)

    def _finish_now(self) -> None:
        try:
            from ..torch_internals import dynamo_compile_lock, inductor_config

            _install_patches()
            with lowering(), dynamo_compile_lock, torch.set_grad_enabled(self._grad), \
                    inductor_config.patch(self._settings), _lowering_here():
                self._same_torch_state("before")
                self._compiled = self._lower(self._finish)
                self._same_torch_state("after")
                self.admits = self._assumed.grown()
                if self.admits is not None and self.assumed_more is not None:
                    self.assumed_more()
            LOWERING_STATS["lowered"] += 1
            LOWERING_STATS["assumed_more"] += self.admits is not None
        except Exception as error:  # noqa: BLE001 - the eager runner stays: right, only slower
            self._finish = [_raise(error)]
        super()._finish_now()


    def _same_torch_state(self, when: str) -> None:
        """The default dtype and torch's process-wide flags as the caller had them: AOTAutograd traces the graph
        again (`torch.ones(n)` takes the default dtype), and the caller may change them meanwhile: then the compiled
        program is not made (its calls stay eager: right, only slower)."""
        if _torch_state() != self._torch_state:
            raise RuntimeError(f"torch's default dtype or process-wide flags changed {when} the lowering")


def _torch_state() -> tuple:
    return torch.get_default_dtype(), global_flags()


def _unset(*args: Any) -> Any:
    raise AssertionError("a background lowering's program was called before it was compiled")


def _raise(error: BaseException) -> Callable[[], None]:
    def again() -> None:
        raise error

    return again


@contextlib.contextmanager
def _lowering_here() -> Iterator[None]:
    _local.lowering = True
    try:
        yield
    finally:
        _local.lowering = False


_patched: list[Any] = []


def _install_patches() -> None:
    """On a lowering thread, AOTAutograd's and Inductor's `preserve_rng_state` leave the global RNG state alone, and
    AOTAutograd's tracing does not switch on anomaly detection, a process-wide flag (see Note: a symbolic graph's
    lowering in the background); elsewhere they are torch's."""
    from ..torch_internals import aot_autograd_module, dynamo_utils_module

    with _patch_lock:
        if _patched:
            return
        for module, target in ((aot_autograd_module, "torch._functorch.aot_autograd.preserve_rng_state"),
                               (dynamo_utils_module, "torch._dynamo.utils.preserve_rng_state")):
            _patched.append(patch_permanently(module, "preserve_rng_state", _elsewhere(module.preserve_rng_state),
                                              target, "a background lowering leaves the global RNG state to the "
                                              "calling thread"))
        detect_anomaly = torch.autograd.anomaly_mode.detect_anomaly
        for name in ("__enter__", "__exit__"):
            _patched.append(patch_permanently(detect_anomaly, name, _not_here(getattr(detect_anomaly, name)),
                                              f"torch.autograd.anomaly_mode.detect_anomaly.{name}", "a background "
                                              "lowering leaves anomaly detection (process-wide) to the calling thread"))


_patch_lock = threading.Lock()


def _elsewhere(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original(...)` (a context manager), except on a lowering thread: a context manager that does nothing."""

    def context(*args: Any, **kwargs: Any) -> Any:
        return contextlib.nullcontext() if getattr(_local, "lowering", False) else original(*args, **kwargs)

    context.__wrapped__ = original  # type: ignore[attr-defined]
    return context


def _not_here(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method`, except on a lowering thread: nothing."""

    def on_this_thread(self: Any, *args: Any) -> Any:
        return None if getattr(_local, "lowering", False) else method(self, *args)

    on_this_thread.__wrapped__ = method  # type: ignore[attr-defined]
    return on_this_thread
