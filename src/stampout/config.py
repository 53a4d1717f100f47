"""Every switch that tunes stampout, in one table (as tinygrad's `ContextVar`s and torch._dynamo.config).

Code reads a switch as `config.name` at the moment it decides, never copies it into a module global or a
default argument, so `patch` reaches every reader. A switch with an environment variable takes its value
from it when stampout is imported (as TORCH_LOGS does). Tests change switches with `config.patch`:

    with stampout.config.patch(glue="whole", check_world=False):
        ...

which refuses unknown names and puts the old values back, also as a decorator. This module imports nothing
of stampout or torch: `import stampout` stays fast.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Switch:
    """One switch: its default, the environment variable that sets it (if any) and what it is for."""

    name: str
    default: Any
    doc: str
    env: str | None = None
    parse: Callable[[str], Any] = str

    def initial(self) -> Any:
        raw = os.environ.get(self.env) if self.env else None
        return self.default if raw is None else self.parse(raw)


SWITCHES: tuple[Switch, ...] = (
    # reports
    Switch("logs", "", "STAMPOUT_LOGS: like TORCH_LOGS, a comma list of log names (_logging.py)", "STAMPOUT_LOGS"),
    Switch("progress", True, "a live progress line on a terminal for long compiles (progress.py)",
           "STAMPOUT_PROGRESS", lambda raw: raw != "0"),
    Switch("progress_delay", 2.0, "seconds a compile runs before the progress line appears"),
    # checks
    Switch("check_world", False, "raise if a fake tensor or symbolic size stays reachable from user state after a "
           "capture (world.py; the test suite sets STAMPOUT_CHECK_WORLD=1)", "STAMPOUT_CHECK_WORLD",
           lambda raw: raw == "1"),
    # how far the world scans and guards look
    Switch("scan_depth", 3, "containers nested deeper than this are not searched for fakes (world.py)"),
    Switch("scan_items", 512, "containers with more items than this are not searched for fakes (world.py)"),
    Switch("guard_max_items", 256, "containers read by a trace with more items are not guarded item by item"),
    Switch("names_max_depth", 3, "how deep names.py looks for the name of a value"),
    Switch("constant_max_numel", 1 << 20, "results larger than this are not folded into constants (constants.py)"),
    Switch("replay_max_bytes", 1 << 30, "an op that fails on fakes is replayed on real tensors up to this size, "
           "to give the real error (op_errors.py)"),
    Switch("watch_installed", False, "code in installed packages (site-packages: transformers, diffusers, a pip "
           "package of yours) is watched as a user's file: its memo caches, registries and globals guarded (code.py; "
           "torch and what it requires stay library code). Off: a venv's site-packages is library code, unwatched; "
           "on: ~2-3x the per-call guard cost on HF models today", "STAMPOUT_WATCH_INSTALLED", lambda raw: raw == "1"),
    # backends
    Switch("glue", "auto", "inductor: 'auto' compiles regions apart with eager glue when split.py finds no reason "
           "not to; 'whole' always hands Inductor the whole graph; 'apart' compiles regions apart wherever possible"),
    Switch("thin_glue", 1.0, "regions are compiled apart when the glue does at most this many times their work"),
    Switch("cpp_wrapper", True, "inductor: graphs without region calls inside compile on CPU with the C++ wrapper"),
    Switch("batch_kernels", True, "inductor: the CPU kernels of each module Inductor's Python wrapper generates "
           "are built as one library (kernel_batch.py)"),
    Switch("background_recompile", True, "inductor: a new size's symbolic recapture compiles on a thread while its "
           "calls run eagerly (background.py)", "STAMPOUT_BACKGROUND_RECOMPILE", lambda raw: raw != "0"),
    Switch("background_lowering", True, "inductor: with background_recompile, the symbolic recapture's AOTAutograd "
           "and lowering run on that thread too, not only its C++ builds (background.Lowering)",
           "STAMPOUT_BACKGROUND_LOWERING", lambda raw: raw != "0"),
    Switch("overlap_builds", True, "inductor: a static recapture's C++ build runs on a thread while its calls run "
           "eagerly (background.py)", "STAMPOUT_OVERLAP_BUILDS",
           lambda raw: raw != "0"),
    Switch("overlap_first_build", False, "inductor: a first capture's C++ build too runs on a thread as a static "
           "recapture's does (the first call returns before it is built: its cost moves to the entry's next call)",
           "STAMPOUT_OVERLAP_FIRST_BUILD", lambda raw: raw == "1"),
    Switch("parallel_regions", 0, "inductor: at most this many worker processes compile a compile's distinct "
           "regions while this one compiles the first (parallel.py); 0 (default, measured: see there): none; -1: the "
           "CPUs less two, at most 4",
           "STAMPOUT_PARALLEL_REGIONS", int),
    Switch("parallel_min_nodes", 40, "inductor: regions with fewer compute nodes are not worth a worker process"),
    Switch("avoid_reused_subgraph_buffer_bug", True, "inductor: no buffer reuse in differentiated graphs with "
           "region calls inside (a torch bug; False only to reproduce it)"),
    Switch("avoid_horizontal_fusion_bug", True, "inductor: no horizontal fusion on CPU (a torch bug; False only "
           "to reproduce it)"),
    # export
    Switch("stamp_out_lowering", True, "export: later region calls with the same operands are stamped out; False "
           "sends every call through torch's invoke_subgraph rule (the reference the fast path is tested against)"),
)

_BY_NAME = {switch.name: switch for switch in SWITCHES}
_MODULE = sys.modules[__name__]

logs: str
progress: bool
progress_delay: float
check_world: bool
scan_depth: int
scan_items: int
guard_max_items: int
names_max_depth: int
constant_max_numel: int
replay_max_bytes: int
watch_installed: bool
glue: str
thin_glue: float
cpp_wrapper: bool
batch_kernels: bool
background_recompile: bool
background_lowering: bool
overlap_builds: bool
overlap_first_build: bool
parallel_regions: int
parallel_min_nodes: int
avoid_reused_subgraph_buffer_bug: bool
avoid_horizontal_fusion_bug: bool
stamp_out_lowering: bool

globals().update({switch.name: switch.initial() for switch in SWITCHES})


def _check(names: Iterable[str]) -> None:
    unknown = sorted(set(names) - _BY_NAME.keys())
    if unknown:
        raise AttributeError(f"stampout.config has no switch {', '.join(unknown)}; the switches: "
                             f"{', '.join(_BY_NAME)}")


def values() -> dict[str, Any]:
    """The switches and their current values."""
    return {name: getattr(_MODULE, name) for name in _BY_NAME}


@contextlib.contextmanager
def patch(**changes: Any) -> Iterator[None]:
    """Set switches for the block (or decorated function), then put the old values back."""
    _check(changes)
    old = {name: getattr(_MODULE, name) for name in changes}
    for name, value in changes.items():
        setattr(_MODULE, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(_MODULE, name, value)
