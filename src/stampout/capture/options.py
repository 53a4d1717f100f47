"""How `capture_program` is asked to capture (`CaptureOptions`), and a program it refuses by what it returns (a
generator or coroutine, whose code would run after the capture)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import CaptureError, message
from ..regions.cache import RegionCache
from ..regions.frame import ProgramIneligible
from ..sources import Source
from ..trace.frames import user_location


@dataclass(frozen=True)
class CaptureOptions:
    """How `capture_program` captures (every field has the default a plain `stampout.capture` uses).

    Input dims are symbolic where marked with `torch._dynamo.mark_dynamic`, all of them with `dynamic=True`, and,
    per flat input leaf, the dims in `automatic` (see shapes.dynamic_dims); `dynamic_sources` does the same for
    tensors the program reads through its input objects (a KV cache's `layers[0].keys`). `ranges` bounds symbolic
    dims: {id(input tensor): {dim: (min, max, _)}}. The int attributes at `dynamic_ints` are read as symbols
    during the capture (inputs of the graph, read per call). With `real=False` (export) the graph is not run to
    store real values on the caller's objects: the caller puts its objects back itself. `body` (a module's
    forward, see sharded.py) is what runs in place of `fn`: the module's hooks run outside. `sharded`: `body`
    makes the calls of FSDP2-sharded modules boundary nodes (capture/sharded_boundaries.py)."""

    cache: RegionCache | None = None  # region entries shared between captures (a fresh one when None)
    guard_program: bool = False  # (compile) guards on everything the whole program read, in `Capture.program`
    dynamic: bool | None = None
    automatic: dict[int, set[int]] | None = None
    dynamic_sources: dict[Source, set[int]] | None = None
    ranges: dict[int, dict[int, tuple]] | None = None
    dynamic_ints: set[Source] | None = None
    real: bool = True
    body: Callable | None = None
    sharded: bool = False


def refuse_lazy(out: Any, guard_program: bool) -> None:
    """A program that returns a generator or coroutine: its code would run later, on the capture's fakes."""
    lazy = f"returns a {type(out).__name__}, whose code runs when it is iterated or awaited (after the capture)"
    out.close()
    if guard_program:  # (compile runs it eagerly)
        raise ProgramIneligible(lazy)
    raise CaptureError(message(f"stampout cannot capture a program that {lazy}", user_location(),
                               "return the items (a list or tuple), or capture the function that computes one"))
