"""Inductor's once-per-process C++ toolchain check: only what decides, started early, remembered.

Before its first CPU kernel, Inductor picks a vector ISA (`pick_vec_isa()`): the first of AMX, AVX512-VNNI,
AVX512, AVX2 that this CPU has and that the C++ compiler can build and the machine can load. To know it,
`valid_vec_isa_list()` checks *every* candidate — `VecISA.check_build` compiles a test program (the heavy
ones include ATen's vectorized headers, about a second each) and `dlopen`s it in a fresh Python process —
one after another, in the middle of the first graph's code generation, in every new process: about 4.5 s
of compiler time cold and 0.8 s of probes with the binaries cached, on 2 cores.

stampout changes when those checks run, never their verdicts:
- `valid_vec_isa_list()` (read only by `pick_vec_isa`, which takes its first entry, or the first that
  matches `ATEN_CPU_CAPABILITY`) becomes a `LazyIsaList` that checks candidates in torch's order only as
  far as it is read: usually the first candidate decides and the others are never compiled;
- `warm_up()`, when a compile starts, plans the first candidate's checks with a dry run of its `__bool__`
  (on a fresh instance, every check answered "yes" and recorded), prepares the compiler command of each
  check whose verdict is not stored on the calling thread (a restart prepares none: that is most of the
  planning's cost), and runs the compiles and probes on background threads — they overlap AOTAutograd and
  lowering, and a thread that mostly waits on a subprocess is not slowed by the busy main thread;
- `VecISA.check_build` goes through a memo: a check already running in the background is waited for
  (never started twice), and every verdict is saved in stampout's store beside Inductor's cache (keyed by
  the test program, compiler, flags, torch version and the CPU's ISA flags), so a restart on the same cache
  directory compiles and probes nothing.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..torch_internals import patch_permanently
from . import store, timing

log = logging.getLogger("stampout.backends")

_NAMESPACE = "vec_isa"
# The torch 2.13 names this module relies on (without them it leaves Inductor's checks alone).
_NEEDED = ("valid_vec_isa_list", "supported_vec_isa_list", "x86_isa_checker", "pick_vec_isa",
           "_get_isa_dry_compile_fingerprint")
_lock = threading.Lock()
_stored: dict[str, bool] | None = None
_running: dict[str, Future] = {}  # verdict key -> the background check's verdict
_original_check_build: Any = None
_planning = threading.local()  # .plan: a list while warm_up() dry-runs a candidate on this thread
# Checks this process: answered from the store, waited for (run in the background), run here.
STATS = {"remembered": 0, "waited": 0, "run": 0}


def _cpu_flags() -> str:
    from ..torch_internals import x86_isa_checker

    return f"{platform.machine()}:{','.join(sorted(x86_isa_checker()))}"


def _verdict_key(isa: Any, code: str) -> str:
    from ..torch_internals import get_isa_dry_compile_fingerprint as _get_isa_dry_compile_fingerprint

    text = f"{type(isa).__name__}\n{_get_isa_dry_compile_fingerprint(isa.build_arch_flags())}\n{_cpu_flags()}\n{code}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _stored_verdicts() -> dict[str, bool]:
    global _stored
    if _stored is None:
        _stored = {k: v for k, v in store.load(_NAMESPACE).items() if isinstance(v, bool)}
    return _stored


def _prepared_check(isa: Any, code: str) -> Callable[[], bool]:
    """`VecISA.check_build(isa, code)` of torch 2.13, split in two: the Python preparation (paths, compiler
    command) here, on the calling thread; the file lock, compile and load probe in the returned thunk."""
    from ..torch_internals import (
        LOCK_TIMEOUT,
        CppBuilder,
        CppTorchOptions,
        FileLock,
        get_lock_dir,
        normalize_path_separator,
    )
    from ..torch_internals import codecache_write as write
    from ..torch_internals import get_isa_dry_compile_fingerprint as _get_isa_dry_compile_fingerprint

    key, input_path = write(code, "cpp", extra=_get_isa_dry_compile_fingerprint(isa.build_arch_flags()))
    builder = CppBuilder(key, [input_path], CppTorchOptions(vec_isa=isa, warning_all=False),
                         os.path.dirname(input_path))
    output_path = normalize_path_separator(builder.get_target_file_path())
    builder.get_command_line()
    lock_path = os.path.join(get_lock_dir(), key + ".lock")

    def run() -> bool:
        with FileLock(lock_path, timeout=LOCK_TIMEOUT):
            try:
                if not os.path.isfile(output_path):
                    builder.build()
            except Exception:  # noqa: BLE001 - torch's check_build: a failed compile means "not supported"
                return False
            return isa._probe_load(output_path)

    return run


def _check_build(isa: Any, code: str) -> bool:
    """`VecISA.check_build` through the memo (see the module docstring)."""
    key = _verdict_key(isa, code)
    plan = getattr(_planning, "plan", None)
    if plan is not None:  # warm_up()'s dry run: record the check, assume it passes
        plan.append((key, isa, code))
        return True
    with _lock:
        verdict = _stored_verdicts().get(key)
        future = _running.get(key)
    if verdict is not None:
        STATS["remembered"] += 1
        return verdict
    if future is not None:
        STATS["waited"] += 1
        with timing.phase("toolchain"):
            return future.result()
    STATS["run"] += 1
    verdict = bool(_original_check_build(isa, code))
    _remember(key, verdict)
    return verdict


def _remember(key: str, verdict: bool) -> None:
    with _lock:
        _stored_verdicts()[key] = verdict
    store.update(_NAMESPACE, {key: verdict})


class LazyIsaList:
    """The valid ISAs in torch's order, each candidate checked only when the list is read that far.
    Reads from several threads are serialized."""

    def __init__(self, candidates: list[Any]) -> None:
        self.candidates = candidates
        self._next = 0
        self._valid: list[Any] = []
        self._lock = threading.Lock()

    def _ensure(self, count: float) -> None:
        with self._lock:
            while len(self._valid) < count and self._next < len(self.candidates):
                isa = self.candidates[self._next]
                if isa:  # VecISA.__bool__: the compile-and-load checks
                    self._valid.append(isa)
                self._next += 1

    def __bool__(self) -> bool:
        self._ensure(1)
        return bool(self._valid)

    def __len__(self) -> int:
        self._ensure(float("inf"))
        return len(self._valid)

    def __getitem__(self, index: Any) -> Any:
        self._ensure(float("inf") if isinstance(index, slice) or index < 0 else index + 1)
        return self._valid[index]

    def __iter__(self) -> Any:
        i = 0
        while True:
            self._ensure(i + 1)
            if i >= len(self._valid):
                return
            yield self._valid[i]
            i += 1

    def __repr__(self) -> str:
        checked = [str(c) for c in self.candidates[:self._next]]
        return f"LazyIsaList(checked={checked}, valid={[str(v) for v in self._valid]})"


@functools.cache
def lazy_valid_vec_isa_list() -> LazyIsaList:
    from ..torch_internals import cpu_vec_isa

    flags = cpu_vec_isa.x86_isa_checker()
    return LazyIsaList([isa for isa in cpu_vec_isa.supported_vec_isa_list
                        if all(flag in flags for flag in str(isa).split())])


def install() -> None:
    """Route Inductor's ISA checks through the memo and, on x86 Linux/Windows while this process has not
    checked yet, the lazy list (idempotent)."""
    global _original_check_build
    from ..torch_internals import cpu_vec_isa

    with _lock:
        if _original_check_build is not None:
            return
        if not all(hasattr(cpu_vec_isa, n) for n in _NEEDED) or not hasattr(cpu_vec_isa.VecISA, "check_build"):
            log.debug("toolchain: this torch's cpu_vec_isa differs from 2.13's; its ISA checks are left alone")
            _original_check_build = False
            return
        _original_check_build = patch_permanently(
            cpu_vec_isa.VecISA, "check_build", _check_build, "torch._inductor.cpu_vec_isa.VecISA.check_build",
            "ISA checks memoized across processes, run in the background")
        x86 = platform.system() in ("Linux", "Windows") and platform.machine() in ("x86_64", "AMD64")
        if x86 and not cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
            patch_permanently(cpu_vec_isa, "valid_vec_isa_list", lazy_valid_vec_isa_list,
                              "torch._inductor.cpu_vec_isa.valid_vec_isa_list", "the ISA list checked lazily")


def _stand_in(isa: Any) -> Any:
    """A fresh instance of a class of its own for the dry run: VecISA's `__bool__` caches are keyed by
    instance equality (dataclass `__eq__`, which compares classes), so its "yes" answers cannot reach the
    instances Inductor checks."""
    cls = type(isa)
    return type(cls.__name__, (cls,), {"__module__": __name__})()


def warm_up() -> None:
    """Start the checks that will decide Inductor's ISA pick on background threads (nothing when this
    process has picked already, or every verdict is stored)."""
    from ..torch_internals import cpu_vec_isa
    from ..torch_internals import inductor_config as config

    install()
    lazy = cpu_vec_isa.valid_vec_isa_list is lazy_valid_vec_isa_list
    if (not lazy or config.cpp.vec_isa_ok is not None or lazy_valid_vec_isa_list.cache_info().currsize
            or os.environ.get("ATEN_CPU_CAPABILITY")):
        return
    candidates = lazy_valid_vec_isa_list().candidates
    if not candidates:
        return
    _planning.plan = []
    try:
        bool(_stand_in(candidates[0]))
        plan = _planning.plan
    finally:
        del _planning.plan
    started = time.perf_counter()
    for key, isa, code in plan:
        with _lock:
            if key in _stored_verdicts() or key in _running:
                continue
        run = _prepared_check(isa, code)
        with _lock:
            if key in _running:
                continue
            future = _running[key] = Future()

        def check(key: str = key, run: Callable[[], bool] = run, future: Future = future) -> None:
            try:
                verdict = bool(run())
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits for the verdict
                future.set_exception(error)
                return
            _remember(key, verdict)
            future.set_result(verdict)
            log.debug("toolchain: ISA check %s -> %s in the background (%.2fs)", key[:8], verdict,
                      time.perf_counter() - started)

        threading.Thread(target=check, name=f"stampout-isa-{key[:8]}", daemon=True).start()
