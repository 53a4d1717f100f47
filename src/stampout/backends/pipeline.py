"""Lowering the next graph while the C++ compiler builds the last one.

Inductor compiles a graph in two halves: Python (lowering, scheduling, code generation) on the calling
thread, then the C++ compiler — kernels on a thread pool, or the one C++-wrapper file — while loading the
generated module, which blocks until every kernel is built. Compiling several graphs one after another
(the forward and the backward of a region, or several distinct regions) therefore leaves one core idle
half the time on a 2-core machine. Inside `overlapped()`, on the calling thread only:

- the generated module's final `async_compile.wait(globals())` is recorded instead of waited on;
- a C++-wrapper build (`CppWrapperCodeCache.load_pybinding`) is submitted to Inductor's compile pool and
  the module gets an entry point that resolves on first use;
- the Python wrapper's kernels (`AsyncCompile.cpp_pybinding`) are collected and built as one library (per
  compile, or per `kernel_batch.CLOSE_AT` kernels), handed to the pool when a module's wait finds the batch full
  or when the context exits (kernel_batch.py; `config.batch_kernels`);

so the next graph's lowering runs while the compiler works. Leaving the context waits for all of it (timed
as `c++ compile`), so the compiled callables are complete before anyone calls them; compile errors surface
there — unless the caller takes the waits (`overlapped(finish_later)`: background.py runs them on a thread and
keeps the compiled callables from being called until they are done). Other threads' compiles are untouched: the hooks are installed while any thread is inside `overlapped()`
and act only for the threads inside (this thread's innermost context, a thread-local); the last thread to leave
puts torch's methods back.

With one compile thread (`TORCHINDUCTOR_COMPILE_THREADS=1`, or `torch._inductor.config.compile_threads = 1`)
Inductor has no pool: `AsyncCompile.submit` runs the build at once, and `load_async` calls it while holding
the build's file lock, which the build takes again through a second lock object — on Linux a second `flock`
on the same file blocks, so the compile would hang until the lock times out. There is nothing to overlap
then, so both hooks leave Inductor's own synchronous path alone; the setting is read per call, as
Inductor reads it, so a change inside the context (a stampout `options=` patch) is seen.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .. import config
from . import kernel_batch, timing


_local = threading.local()  # .inside: the innermost overlapped() of this thread (an _Overlap), or None
_lock = threading.Lock()
_installed: dict[str, Any] = {}  # while any thread is inside overlapped(): what the hooks replaced, and .users


class _Overlap:
    """One overlapped() of one thread: the waits it deferred and its batch of kernels."""

    def __init__(self, batch: kernel_batch.Collector) -> None:
        self.pending: list[Callable[[], Any]] = []
        self.batch = batch


def _current() -> _Overlap | None:
    """This thread's overlapped(), when Inductor has a pool to hand the compiler to."""
    from ..torch_internals import get_compile_threads

    here = getattr(_local, "inside", None)
    return here if here is not None and get_compile_threads() > 1 else None


def batches_kernels() -> bool:
    """Whether the Python-wrapper modules this thread loads now build their kernels as one library each."""
    return _batching(_current())


def _batching(here: _Overlap | None) -> bool:
    """batches_kernels(), for this thread's overlapped() `here` already found."""
    from ..torch_internals import CppPythonBindingsCodeCache

    return here is not None and config.batch_kernels and kernel_batch.supported(CppPythonBindingsCodeCache)


class DeferredEntry:
    """A C++-wrapper entry point whose build was submitted, not waited for."""

    def __init__(self, get: Callable[[], Callable[..., Any]]) -> None:
        self._get = get
        self._fn: Callable[..., Any] | None = None

    def resolve(self) -> Callable[..., Any]:
        if self._fn is None:
            self._fn = self._get()
        return self._fn

    def __call__(self, *args: Any) -> Any:
        return (self._fn or self.resolve())(*args)


def _deferred_wait(self: Any, scope: dict[str, Any]) -> None:
    here = _current()
    if here is None or "__file__" not in scope:  # only generated modules' final wait
        if here is not None:
            here.batch.close()
        return _installed["wait"](self, scope)
    here.batch.close(at_module_end=True)  # (a small batch stays open for the next module's kernels)
    wait = _installed["wait"]  # (called after the context exits, when the hooks may be gone)
    here.pending.append(lambda: wait(self, scope))


def _deferred_load_pybinding(cls: Any, *args: Any, **kwargs: Any) -> Any:
    from ..torch_internals import AsyncCompile

    here = _current()
    if here is None or "submit_fn" in kwargs:
        return _installed["load_pybinding"](cls, *args, **kwargs)
    entry = DeferredEntry(cls.load_pybinding_async(*args, submit_fn=AsyncCompile.submit, **kwargs))
    here.pending.append(entry.resolve)
    return entry


def _batched_cpp_pybinding(self: Any, argtypes: Any, source_code: Any, *args: Any, **kwargs: Any) -> Any:
    here = _current()
    future = here.batch.add(argtypes, source_code) if _batching(here) and not (args or kwargs) else None
    return _installed["cpp_pybinding"](self, argtypes, source_code, *args, **kwargs) if future is None else future


def _install() -> None:
    """The hooks, once for all threads inside overlapped() (each acts only for a thread inside)."""
    from ..torch_internals import AsyncCompile, CppWrapperCodeCache

    with _lock:
        if not _installed:
            _installed.update(wait=AsyncCompile.wait, cpp_pybinding=AsyncCompile.cpp_pybinding,
                              load_pybinding=CppWrapperCodeCache.load_pybinding.__func__,
                              owned="load_pybinding" in CppWrapperCodeCache.__dict__, users=0)
            AsyncCompile.wait = _deferred_wait
            AsyncCompile.cpp_pybinding = _batched_cpp_pybinding
            CppWrapperCodeCache.load_pybinding = classmethod(_deferred_load_pybinding)
        _installed["users"] += 1


def _uninstall() -> None:
    """The originals back once no thread is inside overlapped()."""
    from ..torch_internals import AsyncCompile, CppWrapperCodeCache

    with _lock:
        _installed["users"] -= 1
        if _installed["users"]:
            return
        AsyncCompile.wait = _installed["wait"]
        AsyncCompile.cpp_pybinding = _installed["cpp_pybinding"]
        if _installed["owned"]:
            CppWrapperCodeCache.load_pybinding = classmethod(_installed["load_pybinding"])
        else:
            del CppWrapperCodeCache.load_pybinding
        _installed.clear()


@contextlib.contextmanager
def overlapped(finish_later: list[Callable[[], Any]] | None = None) -> Iterator[None]:
    """Defer Inductor's waits for the C++ compiler on this thread until the context exits; with `finish_later`,
    past it: the waits (and module loads) are appended there, for the caller to run (background.py)."""
    from ..torch_internals import AsyncCompile, CppPythonBindingsCodeCache, CppWrapperCodeCache, LambdaFuture

    if not (hasattr(AsyncCompile, "wait") and hasattr(AsyncCompile, "cpp_pybinding")
            and hasattr(CppWrapperCodeCache, "load_pybinding_async")):
        yield  # not torch 2.13's Inductor: compile without overlap
        return
    here = _Overlap(kernel_batch.Collector(CppPythonBindingsCodeCache, AsyncCompile.submit, LambdaFuture))
    outer, _local.inside = getattr(_local, "inside", None), here
    _install()
    try:
        yield
    finally:
        _local.inside = outer
        _uninstall()
    if finish_later is not None:
        here.batch.close()
        finish_later.extend(here.pending)
        return
    with timing.phase("c++ compile"):  # (the last batch's build handed over, or its library found built)
        here.batch.close()
        for finish in here.pending:
            finish()
