"""`stampout demo`: capture and compile the zoo's Llama-like model, and check both against eager.

The model is `stampout.tools.models.LlamaLike` with random weights and its decoder layers marked as regions
(`regions=True`), run on token ids [2, 8] under `torch.no_grad()` (an inference demo). One layer is traced;
every other layer is stamped out from the cache.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import torch_internals
from .choices import DEMO_BACKENDS as BACKENDS

TOLERANCE = 1e-4  # max abs difference from eager allowed for float32
Step = Callable[[str], AbstractContextManager]


@dataclass
class DemoResult:
    """What the demo measured. Times in seconds; differences are max abs differences from eager."""

    layers: int
    hidden: int
    backend: str
    params: int
    eager_s: float
    first_capture_s: float
    capture_s: float
    stats: Any  # stampout.RegionStats
    capture_diff: float
    compile_s: float
    compile_diff: float
    second_call_s: float
    tolerance: float = TOLERANCE
    notes: list[str] = field(default_factory=list)
    torch_compile_s: float | None = None  # torch.compile's capture + compile + first call, same backend
    torch_compile_diff: float | None = None

    @property
    def ok(self) -> bool:
        return self.capture_diff <= self.tolerance and self.compile_diff <= self.tolerance


def _no_step(description: str) -> AbstractContextManager:
    return contextlib.nullcontext()


def build_model(layers: int, hidden: int) -> torch.nn.Module:
    """The demo's model: LlamaLike with `layers` region-marked decoder layers of width `hidden`."""
    from .models import LlamaConfig, LlamaLike

    if layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    if hidden < 8 or hidden % 8:
        raise ValueError(f"--hidden must be a positive multiple of 8 (4 heads, even head size), got {hidden}")
    config = LlamaConfig(hidden=hidden, heads=4, kv_heads=2, intermediate=2 * hidden, layers=layers)
    return LlamaLike(config, regions=True, seed=0).eval()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def run(layers: int = 80, hidden: int = 64, backend: str = "eager", step: Step = _no_step,
        tolerance: float | None = None, against_torch_compile: bool = False) -> DemoResult:
    """Build the model, capture it, compile it with `backend`; time each step and compare with eager. With
    `against_torch_compile`, torch.compile compiles a second copy of the model with the same backend, timed too.

    `step(description)` is entered around each step (the CLI shows a spinner there). A result is ok when it
    differs from eager by at most `tolerance` (default `TOLERANCE`)."""
    import stampout

    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    stampout.reset()
    with step(f"building a {layers}-layer Llama-like model (hidden {hidden})"):
        model = build_model(layers, hidden)
    ids = torch.randint(0, model.config.vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with step("running it eagerly"):
            expected = model(ids)  # the reference; the first call also pays one-time setup, so time the second
            t0 = time.perf_counter()
            model(ids)
            eager_s = time.perf_counter() - t0
        with step("capturing with stampout.capture"):
            t0 = time.perf_counter()
            cap = stampout.capture(model, ids)
            first_capture_s = time.perf_counter() - t0
            t0 = time.perf_counter()  # the first capture in a process also pays one-time setup: time the second
            cap = stampout.capture(model, ids)
            capture_s = time.perf_counter() - t0
            capture_diff = _max_diff(cap(ids), expected)
        with step(f"compiling with stampout.compile(backend={backend!r}) and running it"):
            compiled = stampout.compile(model, backend=backend)
            t0 = time.perf_counter()
            actual = compiled(ids)
            compile_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            compiled(ids)
            second_call_s = time.perf_counter() - t0
        torch_compile_s = torch_compile_diff = None
        if against_torch_compile:
            with step(f"compiling a fresh copy with torch.compile(backend={backend!r}) and running it"):
                torch_internals.dynamo_reset()
                theirs = torch.compile(build_model(layers, hidden), backend=backend)
                t0 = time.perf_counter()
                torch_out = theirs(ids)
                torch_compile_s = time.perf_counter() - t0
                torch_compile_diff = _max_diff(torch_out, expected)
    notes = []
    if compiled.stats.captures != 1:
        notes.append(f"compile captured {compiled.stats.captures} times (expected 1)")
    return DemoResult(
        layers=layers, hidden=hidden, backend=backend,
        params=sum(p.numel() for p in model.parameters()),
        eager_s=eager_s, first_capture_s=first_capture_s, capture_s=capture_s, stats=cap.stats,
        capture_diff=capture_diff,
        compile_s=compile_s, compile_diff=_max_diff(actual, expected), second_call_s=second_call_s,
        tolerance=TOLERANCE if tolerance is None else tolerance, notes=notes,
        torch_compile_s=torch_compile_s, torch_compile_diff=torch_compile_diff,
    )


def table(result: DemoResult) -> Any:
    """The result as a rich Table."""
    from rich.table import Table

    def diff(d: float) -> str:
        color = "green" if d <= result.tolerance else "red"
        return f"[{color}]{d:.2e}[/{color}]"

    s = result.stats
    t = Table(title=f"stampout demo: Llama-like, {result.layers} layers, hidden {result.hidden}, "
                    f"{result.params / 1e6:.2f}M parameters, ids [2, 8]",
              caption=f"max |diff|: max abs difference from eager, at most {result.tolerance:g} (float32)")
    t.add_column("step")
    t.add_column("time", justify="right")
    t.add_column("max |diff|", justify="right")
    t.add_column("what happened")
    t.add_row("eager forward", f"{result.eager_s * 1e3:.1f} ms", "-", "the reference (second call)")
    t.add_row("stampout.capture", f"{result.capture_s * 1e3:.1f} ms", diff(result.capture_diff),
              f"region calls: {s.traces} traced, {s.reuses} reused, {s.dedups} deduped; "
              f"{s.subgraphs} distinct subgraph{'s' if s.subgraphs != 1 else ''}")
    t.add_row("  first in this process", f"{result.first_capture_s * 1e3:.1f} ms", "-",
              "the same, plus one-time setup (imports, first fake tensors)")
    t.add_row(f"stampout.compile, {result.backend}", f"{result.compile_s * 1e3:.1f} ms",
              diff(result.compile_diff), "capture + compile + first call")
    t.add_row("  second call", f"{result.second_call_s * 1e3:.1f} ms", "-", "guards + compiled code")
    if result.torch_compile_s is not None:
        ratio = result.torch_compile_s / result.compile_s if result.compile_s else float("inf")
        t.add_row(f"torch.compile, {result.backend}", f"{result.torch_compile_s * 1e3:.1f} ms",
                  diff(result.torch_compile_diff), f"capture + compile + first call ({ratio:.1f}x stampout's)")
    return t
