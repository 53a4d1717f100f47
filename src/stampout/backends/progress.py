"""A progress line for compiles that take more than a couple of seconds: graphs compiled so far, cache hits.

Shown on a terminal only (stderr is a TTY), transient (it disappears when the compile ends), never a log
record and never written to pipes or files; `STAMPOUT_PROGRESS=0` turns it off. Backends report through
`expect()` and `compiled()`; with no compile open they do nothing.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

from .. import config

_local = threading.local()


class Progress:
    """One compile: what it is, the graphs it will compile, those done and those found in the cache."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.expected = 0
        self.done = 0
        self.cached = 0
        self.started = time.perf_counter()
        self.shown = False

    def text(self) -> str:
        graphs = f"{self.done}/{self.expected} graphs" if self.expected else f"{self.done} graphs"
        cached = f", {self.cached} from the cache" if self.cached else ""
        return f"stampout: compiling {self.what}: {graphs}{cached} ({time.perf_counter() - self.started:.0f} s)"


class _Line:
    """What the live display renders on each refresh: a spinner and the current text."""

    def __init__(self, progress: Progress) -> None:
        from rich.spinner import Spinner

        self.progress = progress
        self.spinner = Spinner("dots")

    def __rich__(self) -> Any:
        self.spinner.text = self.progress.text()
        return self.spinner


def current() -> Progress | None:
    return getattr(_local, "progress", None)


def expect(graphs: int) -> None:
    """The compile open on this thread will compile `graphs` more graphs."""
    progress = current()
    if progress is not None:
        progress.expected += graphs


def compiled(from_cache: bool = False) -> None:
    """A graph of the compile open on this thread is compiled (or was loaded from the cache)."""
    progress = current()
    if progress is not None:
        progress.done += 1
        progress.cached += from_cache


def _wanted(stream: TextIO) -> bool:
    if not config.progress:
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@contextlib.contextmanager
def compiling(what: str, stream: TextIO | None = None, force: bool = False) -> Iterator[Progress]:
    """Open a compile on this thread; after `config.progress_delay` seconds a live line shows its progress on
    `stream` (stderr) if that is a terminal (`force`: on any stream, for tests)."""
    stream = sys.stderr if stream is None else stream
    progress = Progress(what)
    outer = current()
    _local.progress = progress
    live: list[Any] = []
    lock = threading.Lock()
    closed = False

    def show() -> None:
        from rich.console import Console
        from rich.live import Live

        with lock:
            if closed:
                return
            console = Console(file=stream, force_terminal=True if force else None)
            display = Live(_Line(progress), console=console, transient=True, refresh_per_second=4,
                           redirect_stdout=False, redirect_stderr=False)
            display.start()
            live.append(display)
            progress.shown = True

    timer = threading.Timer(config.progress_delay, show) if outer is None and (force or _wanted(stream)) else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield progress
    finally:
        with lock:
            closed = True
            if timer is not None:
                timer.cancel()
            for display in live:
                display.stop()
        _local.progress = outer
