"""How capture time grows with depth: stampout vs Dynamo, flat vs regions.

    python bench/capture_depth.py --depths 1 8 32 --repeat 3

For each depth N (``LlamaLike(layers=N)``, ids [2, 8]) and each variant, the median over ``--repeat``
fresh runs (a new model each time, caches reset before each) of:

  stampout flat      stampout.capture(model, ids)                        plain DecoderLayer
  stampout regions   stampout.capture(model, ids)                        forward = stampout.region(...)
  dynamo flat        torch.compile(model, backend=<gm.forward>, fullgraph=True)(ids), first call
  dynamo nested      same, forward = torch.compiler.nested_compile_region(...)

The Dynamo backend returns ``gm.forward`` (no compiler), so its time is Dynamo's capture plus one
eager run. A variant that fails is reported as ``error: ...`` (stampout is a work in progress).
Raw numbers go to bench/out/capture_depth.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from bench.common import fmt_ms as _ms  # noqa: E402
from bench.common import fmt_ratio as _ratio  # noqa: E402
from bench.common import reset_all as _reset_all  # noqa: E402
from stampout.models import LlamaConfig, LlamaLike  # noqa: E402

VARIANTS = ("stampout_flat", "stampout_regions", "dynamo_flat", "dynamo_nested")
LABELS = {
    "stampout_flat": "stampout flat",
    "stampout_regions": "stampout regions",
    "dynamo_flat": "dynamo flat",
    "dynamo_nested": "dynamo nested",
}


def _model(variant: str, depth: int) -> torch.nn.Module:
    regions = {
        "stampout_flat": False,
        "stampout_regions": True,
        "dynamo_flat": False,
        "dynamo_nested": "nested",
    }
    return LlamaLike(LlamaConfig(layers=depth), regions=regions[variant], seed=0)


def _dynamo_metrics() -> dict[str, list[float]] | None:
    """Dynamo's per-phase timing dict, cleared (None if this torch has none)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # pragma: no cover
        return None
    compilation_time_metrics.clear()
    return compilation_time_metrics


def _run_once(variant: str, depth: int, ids: torch.Tensor) -> tuple[float, dict[str, Any]]:
    """Build a fresh model, reset caches, time one capture. Returns (seconds, extra facts)."""
    model = _model(variant, depth)
    _reset_all()
    extra: dict[str, Any] = {}
    if variant.startswith("stampout"):
        import stampout

        t0 = time.perf_counter()
        cap = stampout.capture(model, ids)
        dt = time.perf_counter() - t0
        st = getattr(cap, "stats", None)
        if st is not None:
            extra = {k: getattr(st, k, None) for k in ("traces", "reuses", "dedups", "subgraphs")}
        extra["nodes"] = len(cap.gm.graph.nodes)
    else:
        graphs: list[torch.fx.GraphModule] = []

        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            graphs.append(gm)
            return gm.forward

        metrics = _dynamo_metrics()
        t0 = time.perf_counter()
        torch.compile(model, backend=backend, fullgraph=True)(ids)
        dt = time.perf_counter() - t0
        extra = {"graphs": len(graphs), "nodes": sum(len(g.graph.nodes) for g in graphs)}
        if metrics is not None:
            # Dynamo's own capture time, without running the captured code (with grad enabled, the
            # eager run of invoke_subgraph nodes is slow and would dominate the nested variant).
            extra["capture_s"] = sum(metrics.get("_compile.compile_inner", []))
        if variant == "dynamo_nested":
            extra["subgraphs"] = sum(
                1
                for g in graphs
                for n, _ in g.named_children()
                if n.startswith(("subgraph", "invoke_subgraph"))
            )
    return dt, extra


def _check_numerics(variant: str, depth: int, ids: torch.Tensor) -> str | None:
    """For stampout variants: does ``cap(ids)`` equal eager? Returns None if ok, else a message."""
    if not variant.startswith("stampout"):
        return None
    import stampout

    model = _model(variant, depth)
    _reset_all()
    try:
        cap = stampout.capture(model, ids)
        torch.testing.assert_close(cap(ids), model(ids))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120]
    return None


def measure(depths: list[int], repeat: int, variants: list[str], warmup: bool = True) -> dict[str, Any]:
    ids = torch.randint(0, LlamaConfig().vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    results: dict[str, dict[int, dict[str, Any]]] = {v: {} for v in variants}
    for v in variants:
        if warmup:  # first-use costs (imports, Dynamo's one-time setup) are not what we measure
            with contextlib.suppress(Exception):
                _run_once(v, 1, ids)
        for d in depths:
            times: list[float] = []
            extra: dict[str, Any] = {}
            err = None
            capture_times: list[float] = []
            for _ in range(repeat):
                try:
                    dt, extra = _run_once(v, d, ids)
                    times.append(dt)
                    if "capture_s" in extra:
                        capture_times.append(extra.pop("capture_s"))
                except Exception as e:  # noqa: BLE001
                    msg = str(e).splitlines()[0] if str(e) else ""
                    err = f"{type(e).__name__}: {msg}"[:160]
                    extra = {"traceback": traceback.format_exc(limit=6)}
                    break
            results[v][d] = {
                "times_s": times,
                "median_s": statistics.median(times) if times and err is None else None,
                "error": err,
                **extra,
            }
            if capture_times and err is None:
                results[v][d]["capture_times_s"] = capture_times
                results[v][d]["capture_median_s"] = statistics.median(capture_times)
        _reset_all()
    return results


def _measure_and_check(depths: list[int], repeat: int, variants: list[str], check: bool) -> dict[str, Any]:
    results = measure(depths, repeat, variants)
    if check:
        ids = torch.randint(0, LlamaConfig().vocab, (2, 8), generator=torch.Generator().manual_seed(0))
        for v in variants:
            for d in depths:
                r = results[v][d]
                if r.get("error") is None and v.startswith("stampout"):
                    r["numerics"] = _check_numerics(v, d, ids)
        _reset_all()
    return results


def _run_worker(variant: str, depths: list[int], repeat: int, no_check: bool) -> dict[int, dict[str, Any]]:
    """Measure one variant in a fresh interpreter; a crash becomes an error entry for every depth."""
    import subprocess

    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        variant,
        "--repeat",
        str(repeat),
        "--depths",
        *map(str, depths),
    ]
    if no_check:
        cmd.append("--no-check")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=_ROOT, check=False)
    try:
        raw = json.loads(proc.stdout.strip().splitlines()[-1])
        return {int(d): r for d, r in raw.items()}
    except (IndexError, json.JSONDecodeError):
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        err = f"worker exited {proc.returncode}: {tail[-1] if tail else ''}"[:160]
        return {d: {"times_s": [], "median_s": None, "error": err, "stderr_tail": tail[-20:]} for d in depths}


def capture_time(r: dict[str, Any] | None) -> float | None:
    """Capture-only median (s): stampout's capture time; Dynamo's ``compile_inner`` time when known."""
    if not r or r.get("error"):
        return None
    return r.get("capture_median_s", r.get("median_s"))


def _cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    if r.get("error"):
        return f"[red]error: {r['error'].split(':')[0][:24]}[/red]"
    if "capture_median_s" in r:
        return f"{_ms(r['capture_median_s'])} ({_ms(r['median_s'])})"
    return _ms(r["median_s"])


def per_layer_cost(res: dict[int, dict[str, Any]], depth: int) -> float | None:
    """(t(N) - t(1)) / (N - 1) of the capture-only time, in seconds; needs depth 1 measured."""
    if depth <= 1 or 1 not in res or depth not in res:
        return None
    t1, tn = capture_time(res[1]), capture_time(res[depth])
    if t1 is None or tn is None:
        return None
    return (tn - t1) / (depth - 1)


def report(results: dict[str, Any], depths: list[int]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        print(json.dumps(results, indent=1, default=str))
        return

    table = Table(
        title="capture time vs depth (LlamaLike, ids [2, 8]; median ms)",
        caption="dynamo cells: capture only (Dynamo compile_inner), then end to end first call in ( ). "
        "Ratios and per-layer costs use capture-only times.",
    )
    table.add_column("depth", justify="right")
    for v in results:
        table.add_column(LABELS[v], justify="right")
    pairs = [
        ("dynamo_flat", "stampout_flat", "dyn/so flat"),
        ("dynamo_nested", "stampout_regions", "nested/regions"),
    ]
    pairs = [p for p in pairs if p[0] in results and p[1] in results]
    for _, _, title in pairs:
        table.add_column(title, justify="right")
    per_layer = [
        v for v in ("stampout_regions", "dynamo_nested", "stampout_flat", "dynamo_flat") if v in results
    ]
    for v in per_layer:
        table.add_column(f"{LABELS[v]} ms/added layer", justify="right")
    if "stampout_regions" in results:
        table.add_column("regions traces/reuses/subgraphs", justify="right")

    for d in depths:
        row = [str(d)]
        row += [_cell(results[v].get(d)) for v in results]
        row += [_ratio(capture_time(results[a].get(d)), capture_time(results[b].get(d))) for a, b, _ in pairs]
        row += [_ms(per_layer_cost(results[v], d)) for v in per_layer]
        if "stampout_regions" in results:
            r = results["stampout_regions"].get(d) or {}
            row.append(
                "-"
                if r.get("error")
                else f"{r.get('traces', '-')}/{r.get('reuses', '-')}/{r.get('subgraphs', '-')}"
            )
        table.add_row(*row)
    console = Console(width=max(Console().width, 200))
    console.print(table)
    for v, per_depth in results.items():
        for d, r in per_depth.items():
            if r.get("error"):
                console.print(f"[red]{LABELS[v]} depth {d}:[/red] {r['error']}")
            if r.get("numerics"):
                console.print(
                    f"[yellow]{LABELS[v]} depth {d} result differs from eager:[/yellow] {r['numerics']}"
                )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--no-check", action="store_true", help="skip checking stampout results against eager")
    p.add_argument("--out", default=os.path.join(_HERE, "out", "capture_depth.json"))
    p.add_argument(
        "--in-process",
        action="store_true",
        help="measure every variant in this process (default: one subprocess per variant, so "
        "state a failed capture leaves behind cannot skew the other variants' times)",
    )
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    depths = sorted(set(args.depths))
    if args.worker:
        # One variant, in this process; results as JSON on the last line of stdout.
        res = _measure_and_check(depths, args.repeat, [args.worker], check=not args.no_check)
        print(json.dumps({str(d): r for d, r in res[args.worker].items()}, default=str))
        return 0

    t_start = time.perf_counter()
    if args.in_process:
        results = _measure_and_check(depths, args.repeat, args.variants, check=not args.no_check)
    else:
        results = {v: _run_worker(v, depths, args.repeat, args.no_check) for v in args.variants}
    total = time.perf_counter() - t_start
    report(results, depths)

    for v in results:
        for d in depths:
            c = per_layer_cost(results[v], d)
            if c is not None:
                results[v][d]["per_added_layer_s"] = c
    payload = {
        "bench": "capture_depth",
        "model": "LlamaLike",
        "input": [2, 8],
        "depths": depths,
        "repeat": args.repeat,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "total_s": total,
        "results": {v: {str(d): r for d, r in per_depth.items()} for v, per_depth in results.items()},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    print(f"wrote {args.out} ({total:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
