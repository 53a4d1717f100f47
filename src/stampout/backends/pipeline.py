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
there. Other threads' compiles are untouched.

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


_local = threading.local()  # .inside: this thread is inside overlapped()


def batches_kernels() -> bool:
    """Whether the Python-wrapper modules this thread loads now build their kernels as one library each."""
    from ..torch_internals import CppPythonBindingsCodeCache, get_compile_threads

    return (getattr(_local, "inside", False) and config.batch_kernels and get_compile_threads() > 1
            and kernel_batch.supported(CppPythonBindingsCodeCache))


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


@contextlib.contextmanager
def overlapped() -> Iterator[None]:
    """Defer Inductor's waits for the C++ compiler on this thread until the context exits."""
    from ..torch_internals import (
        AsyncCompile,
        CppPythonBindingsCodeCache,
        CppWrapperCodeCache,
        LambdaFuture,
        get_compile_threads,
    )

    if not (hasattr(AsyncCompile, "wait") and hasattr(CppWrapperCodeCache, "load_pybinding_async")):
        yield  # not torch 2.13's Inductor: compile without overlap
        return
    thread = threading.get_ident()
    pending: list[Callable[[], Any]] = []
    wait = AsyncCompile.wait
    load_pybinding = CppWrapperCodeCache.load_pybinding.__func__
    owned = "load_pybinding" in CppWrapperCodeCache.__dict__
    cpp_pybinding = AsyncCompile.cpp_pybinding
    batch = kernel_batch.Collector(CppPythonBindingsCodeCache, AsyncCompile.submit, LambdaFuture)

    def ours() -> bool:  # this thread's compile, and Inductor has a pool to hand the compiler to
        return threading.get_ident() == thread and get_compile_threads() > 1

    def deferred_wait(self: Any, scope: dict[str, Any]) -> None:
        if not ours() or "__file__" not in scope:  # only generated modules' final wait
            if ours():
                batch.close()
            return wait(self, scope)
        batch.close(at_module_end=True)  # (a small batch stays open for the next module's kernels)
        pending.append(lambda: wait(self, scope))

    def deferred_load_pybinding(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if not ours() or "submit_fn" in kwargs:
            return load_pybinding(cls, *args, **kwargs)
        entry = DeferredEntry(cls.load_pybinding_async(*args, submit_fn=AsyncCompile.submit, **kwargs))
        pending.append(entry.resolve)
        return entry

    def batched_cpp_pybinding(self: Any, argtypes: Any, source_code: Any, *args: Any, **kwargs: Any) -> Any:
        future = batch.add(argtypes, source_code) if ours() and batches_kernels() and not (args or kwargs) else None
        return cpp_pybinding(self, argtypes, source_code, *args, **kwargs) if future is None else future

    outer, _local.inside = getattr(_local, "inside", False), True
    AsyncCompile.wait = deferred_wait
    AsyncCompile.cpp_pybinding = batched_cpp_pybinding
    CppWrapperCodeCache.load_pybinding = classmethod(deferred_load_pybinding)
    try:
        yield
    finally:
        AsyncCompile.wait = wait
        AsyncCompile.cpp_pybinding = cpp_pybinding
        _local.inside = outer
        if owned:
            CppWrapperCodeCache.load_pybinding = classmethod(load_pybinding)
        else:
            del CppWrapperCodeCache.load_pybinding
    batch.close()
    with timing.phase("c++ compile"):
        for finish in pending:
            finish()
