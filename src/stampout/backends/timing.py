"""Where compile time goes: `STAMPOUT_LOGS=+timing` (or `timing` for one line per compile).

A *record* is one thing a user waits for (a backend compile, a lazily compiled backward, a first run);
*phases* inside it are timed exclusively: a phase opened inside another is subtracted from the outer
one, so a record's phases add up to its wall time. The names are fixed so benches can sum them:

  capture            stampout's tracer (timed by the caller around `capture_program`)
  toolchain          waiting for Inductor's once-per-process C++ ISA checks (see backends/toolchain.py)
  aot autograd       AOTAutograd: tracing, functionalization, partitioning, its cache key
  inductor lowering  Inductor: graph passes, lowering, scheduling, code generation
  c++ compile        waiting for the C++ compiler (kernels compile on a thread pool)
  module load        importing the generated module and loading compiled kernels
  cache load         a whole graph found in the AOTAutograd / FX graph cache (key, lookup, load)
  region workers     waiting for a worker process compiling a distinct region (parallel.py)
  glue               building the eager outer graph that calls compiled regions
  first run          the first call of the compiled callable

Every finished record is appended to `RECORDS` (benches read it) and logged on `stampout.timing`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

log = logging.getLogger("stampout.timing")

PHASES = ("capture", "toolchain", "aot autograd", "inductor lowering", "c++ compile", "module load",
          "cache load", "region workers", "glue", "first run")


@dataclass
class Record:
    """One timed wait: what it was, its wall time, and the exclusive seconds of each phase in it."""

    what: str
    wall: float = 0.0
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def move(self, source: str, target: str, seconds: float) -> None:
        """Re-attribute `seconds` of phase `source` to `target` (at most what `source` has)."""
        seconds = max(0.0, min(seconds, self.seconds.get(source, 0.0)))
        if seconds:
            self.add(source, -seconds)
            self.add(target, seconds)

    def __str__(self) -> str:
        parts = [f"{name} {s:.2f}s" for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1]) if s >= 0.005]
        return f"{self.what}: {self.wall:.2f}s" + (f" ({', '.join(parts)})" if parts else "")


RECORDS: list[Record] = []
_local = threading.local()


def _stack() -> list[list]:
    if not hasattr(_local, "stack"):
        _local.stack = []  # [phase name, start, seconds spent in nested phases]
        _local.records = []
    return _local.stack


def current() -> Record | None:
    """The innermost open record on this thread."""
    _stack()
    return _local.records[-1] if _local.records else None


@contextlib.contextmanager
def record(what: str) -> Iterator[Record]:
    """Open a record; phases timed on this thread until it closes belong to it. Time not inside any
    phase is reported as `other`."""
    rec = Record(what)
    _stack()
    _local.records.append(rec)
    start = time.perf_counter()
    try:
        with phase("other"):
            yield rec
    finally:
        _local.records.pop()
        rec.wall = time.perf_counter() - start
        if rec.seconds.get("other", 0.0) < 0.0005:
            rec.seconds.pop("other", None)
        RECORDS.append(rec)
        if log.isEnabledFor(logging.INFO):
            log.info("%s", rec)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time `name` exclusively within the current record (no record open: not timed)."""
    stack = _stack()
    if not _local.records:
        yield
        return
    rec = _local.records[-1]
    entry = [name, time.perf_counter(), 0.0]
    stack.append(entry)
    try:
        yield
    finally:
        stack.pop()
        elapsed = time.perf_counter() - entry[1]
        rec.add(name, elapsed - entry[2])
        if stack:
            stack[-1][2] += elapsed
