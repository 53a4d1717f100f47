"""Helpers shared by the benchmarks in bench/: cache resets, formatting, subprocess workers, JSON output.

Import as ``from bench.common import ...`` (each script puts the repository root on ``sys.path`` first)
or, from a script run directly, ``from common import ...``.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT_DIR = os.path.join(HERE, "out")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402


def reset_all() -> None:
    """``stampout.reset()`` (reported, not raised, if it fails), ``torch._dynamo.reset()``, a GC pass."""
    try:
        import stampout

        if hasattr(stampout, "reset"):
            stampout.reset()
    except Exception as e:  # noqa: BLE001 - the library is a work in progress; a broken reset is reported
        print(f"stampout.reset() failed: {type(e).__name__}: {e}", file=sys.stderr)
    torch._dynamo.reset()
    gc.collect()


def fmt_ms(t: float | None) -> str:
    """Seconds as milliseconds with one decimal; ``-`` for None."""
    return "-" if t is None else f"{t * 1e3:.1f}"


def fmt_ratio(num: float | None, den: float | None) -> str:
    """``num / den`` as ``1.23x``; ``-`` when either is missing or ``den`` is 0."""
    return "-" if num is None or den is None or den == 0 else f"{num / den:.2f}x"


def short_error(e: BaseException, limit: int = 160) -> str:
    """``Type: first line of the message``, truncated."""
    msg = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {msg}"[:limit]


def run_json_worker(
    cmd: list[str], timeout: float | None = None, env: dict[str, str] | None = None
) -> tuple[Any, dict[str, Any] | None]:
    """Run ``cmd`` in a fresh interpreter (cwd = repository root); parse the JSON on its last stdout line.

    Returns ``(result, None)`` on success, else ``(None, error_entry)`` where ``error_entry`` has
    ``error`` (one line) and ``stderr_tail`` (the last 20 lines of the worker's stderr or stdout).
    """
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, cwd=ROOT, check=False, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return None, {"error": f"worker timed out after {timeout:.0f}s", "stderr_tail": tail.splitlines()[-20:]}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1]), None
    except (IndexError, json.JSONDecodeError):
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        err = f"worker exited {proc.returncode}: {tail[-1] if tail else ''}"[:160]
        return None, {"error": err, "stderr_tail": tail[-20:]}


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded with every benchmark's raw numbers."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
    }


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


def finish(path: str, payload: dict[str, Any]) -> int:
    """Write a bench's raw numbers and say where (the exit code of a bench's main)."""
    write_json(path, payload)
    print(f"wrote {path} ({payload['total_s']:.1f}s)")
    return 0


def console(min_width: int = 160):
    """A rich Console at least ``min_width`` wide (tables stay on one line in logs)."""
    from rich.console import Console

    return Console(width=max(Console().width, min_width))
