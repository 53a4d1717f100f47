"""Export and AOTInductor packaging: stampout.export vs torch.export, flat and with nested_compile_region.

    python bench/export.py                              # export at 8 and 32 layers, AOTInductor at 16
    python bench/export.py --quick                      # export at 2 layers, AOTInductor at 2
    python bench/export.py --export-layers 8 --aoti-layers 16 --repeat 3

Model: ``LlamaLike(LlamaConfig(layers=N))`` from ``stampout.tools.models`` (hidden 64), ids [2, 8], eval mode.

Export (time to an ``ExportedProgram``; median of ``--repeat`` runs on fresh models, after one untimed
warm-up export of the same variant at 1 layer):

  stampout             stampout.export(model, ids)                     forward = stampout.region
  torch flat           torch.export.export(model, (ids,), strict=False)   plain layers
  torch nested         torch.export.export(..., strict=True)            nested_compile_region (regions kept)
  torch nested (ns)    torch.export.export(..., strict=False)           nested_compile_region (regions inlined)

AOTInductor (time of ``torch._inductor.aoti_compile_and_package(ep)``; the export before it is timed apart):

  stampout             the program of stampout.export (stampout's fixes for torch 2.13 in place)
  torch flat           the flat program of torch.export
  torch nested         torch.export strict with nested_compile_region, torch 2.13 as it is
  torch nested+fix     the same program with stampout.export.aoti.enable_aoti_regions() (no other stampout code)
  flat+stampout.aoti   the flat program with stampout.export.aoti.enable_aoti_regions(): no regions to fix, so this is
                       what stampout's toolchain change alone (ISA checks, stampout/export/aoti.py) does to torch flat

AOTInductor cells run ``--aoti-repeat`` rounds, each round every variant once in turn (so a busy spell on the
shared machine hits all variants alike); the median of the rounds is reported, the minimum is in the JSON. Beside
the wall time, "cpu" is the CPU time the package step used (the process's threads and the compiler processes
it ran), which other work on the machine changes far less than the wall time.

Every cell runs in a fresh interpreter with a fresh, private Inductor cache (``TORCHINDUCTOR_CACHE_DIR``,
FX graph and AOTAutograd caches off); imports happen before the clock. Each result is checked against
eager (``ep.module()`` for export, the loaded package for AOTInductor). "regions lowered" counts Inductor's
subgraph lowerings (``GraphLowering.make_subgraph``): one per distinct region is compiling it once. The
time of a first AOTInductor compile of a one-Linear module in a fresh process (the least of two runs) is
reported for scale; ratios are peer time / stampout time. Raw numbers go to bench/out/export.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from bench.common import console, environment, finish, reset_all, run_json_worker, short_error  # noqa: E402
from stampout.tools.models import LlamaConfig, LlamaLike  # noqa: E402

EXPORT_VARIANTS = ("stampout", "torch_flat", "torch_nested", "torch_nested_ns")
AOTI_VARIANTS = ("stampout", "torch_flat", "torch_nested", "torch_nested_fix", "torch_flat_fix")
LABELS = {"stampout": "stampout", "torch_flat": "torch flat", "torch_nested": "torch nested",
          "torch_nested_ns": "torch nested (ns)", "torch_nested_fix": "torch nested+fix",
          "torch_flat_fix": "flat+stampout.aoti"}
REGIONS: dict[str, bool | str] = {"stampout": True, "torch_flat": False, "torch_nested": "nested",
                                  "torch_nested_ns": "nested", "torch_nested_fix": "nested", "torch_flat_fix": False}
INVOKE = torch.ops.higher_order.invoke_subgraph
TOLERANCE = 1e-4


# ---------------------------------------------------------------------------------------- worker


def _model(variant: str, layers: int) -> tuple[torch.nn.Module, torch.Tensor]:
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaLike(LlamaConfig(layers=layers), regions=REGIONS[variant], seed=None).eval(), ids


def _export(variant: str, model: torch.nn.Module, ids: torch.Tensor) -> torch.export.ExportedProgram:
    if variant == "stampout":
        import stampout

        return stampout.export(model, ids)
    return torch.export.export(model, (ids,), strict=variant in ("torch_nested", "torch_nested_fix"))


def _shape(ep: torch.export.ExportedProgram) -> dict[str, int]:
    calls = ep.graph.find_nodes(op="call_function", target=INVOKE)
    return {"region_calls": len(calls), "subgraphs": len({c.args[0].target for c in calls})}


def run_export(variant: str, layers: int, repeat: int) -> dict[str, Any]:
    model, ids = _model(variant, 1)
    _export(variant, model, ids)  # warm-up: lazy imports, first fake tensors, Dynamo's first frame
    times = []
    for _ in range(repeat):
        reset_all()
        model, ids = _model(variant, layers)
        t0 = time.perf_counter()
        ep = _export(variant, model, ids)
        times.append(time.perf_counter() - t0)
    with torch.no_grad():
        diff = (ep.module()(ids) - model(ids)).abs().max().item()
    return {"times_s": times, "median_s": statistics.median(times), "max_abs_diff": diff, **_shape(ep)}


def run_aoti(variant: str, layers: int, package_dir: str) -> dict[str, Any]:
    from torch._inductor.graph import GraphLowering

    if variant == "floor":
        model: torch.nn.Module = torch.nn.Linear(16, 16).eval()
        ids = torch.randn(2, 16)
    else:
        model, ids = _model(variant, layers)
    if variant in ("torch_nested_fix", "torch_flat_fix"):
        from stampout.export.aoti import enable_aoti_regions

        enable_aoti_regions()
    t0 = time.perf_counter()
    ep = torch.export.export(model, (ids,)) if variant == "floor" else _export(variant, model, ids)
    export_s = time.perf_counter() - t0
    lowered: list[str] = []
    make_subgraph = GraphLowering.make_subgraph

    def counting(self: GraphLowering, *args: Any, **kwargs: Any) -> Any:
        lowered.append(kwargs.get("subgraph_name", args[-1] if args else "?"))
        return make_subgraph(self, *args, **kwargs)

    GraphLowering.make_subgraph = counting  # type: ignore[method-assign]
    cpu0 = _cpu_s()
    t1 = time.perf_counter()
    path = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(package_dir, "model.pt2"))
    package_s = time.perf_counter() - t1
    cpu_s = _cpu_s() - cpu0
    runner = torch._inductor.aoti_load_package(path)
    with torch.no_grad():
        diff = (runner(ids) - model(ids)).abs().max().item()
    return {"median_s": package_s, "cpu_s": cpu_s, "export_s": export_s, "max_abs_diff": diff,
            "regions_lowered": len(lowered),
            "package_bytes": os.path.getsize(path), **_shape(ep)}


def _cpu_s() -> float:
    """CPU seconds of this process (all threads) and of the compiler processes it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def worker(kind: str, variant: str, layers: int, repeat: int, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    for module in ("torch._dynamo", "torch._inductor.compile_fx", "torch._inductor.codegen.cpp_wrapper_cpu",
                   "stampout", "torch._export.passes.lift_constants_pass"):
        importlib.import_module(module)  # import time is not measured
    if kind == "export":
        return run_export(variant, layers, repeat)
    package_dir = tempfile.mkdtemp(prefix="stampout_export_pkg_")
    try:
        return run_aoti(variant, layers, package_dir)
    finally:
        shutil.rmtree(package_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------- parent


def _cell(kind: str, variant: str, layers: int, args: argparse.Namespace) -> dict[str, Any]:
    cache_dir = tempfile.mkdtemp(prefix=f"stampout_export_{kind}_{variant}_{layers}_")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
               TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, variant, str(layers),
           "--repeat", str(args.repeat), "--threads", str(args.threads)]
    t0 = time.perf_counter()
    try:
        result, error = run_json_worker(cmd, timeout=args.timeout, env=env)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    out = result if error is None else {"median_s": None, **error}
    out["worker_wall_s"] = time.perf_counter() - t0
    ok = out.get("error") is None and out.get("max_abs_diff", 1.0) <= TOLERANCE
    print(f"  {kind:>6} {layers:>3} {LABELS.get(variant, variant):>18}: "
          + (out["error"] if out.get("error") else f"{out['median_s']:.3f} s" + ("" if ok else " WRONG")),
          file=sys.stderr, flush=True)
    return out


def _rounds(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's AOTInductor rounds as one cell: the median time (None if any round failed), every time."""
    times = [c.get("median_s") for c in cells]
    out = dict(cells[0])
    out["times_s"], out["cpu_times_s"] = times, [c.get("cpu_s") for c in cells]
    if all(t is not None for t in times):
        out["median_s"], out["min_s"] = statistics.median(times), min(times)
        out["cpu_s"] = statistics.median(out["cpu_times_s"])
        out["max_abs_diff"] = max(c["max_abs_diff"] for c in cells)
    else:
        out["median_s"] = None
        out.setdefault("error", next((c.get("error") for c in cells if c.get("error")), "a round failed"))
    return out


def _s(t: float | None) -> str:
    return "-" if t is None else f"{t:.3f}" if t < 10 else f"{t:.1f}"


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str = "median_s") -> str:
    x, y = a.get(key), b.get(key)
    return "-" if x is None or not y else f"{x / y:.2f}x"


def _cell_text(r: dict[str, Any]) -> str:
    if r.get("error"):
        return f"[red]{r['error'].split(':')[0][:24]}[/red]"
    text = f"{_s(r['median_s'])} ({r['region_calls']}/{r['subgraphs']}"
    text += f"/{r['regions_lowered']})" if "regions_lowered" in r else ")"
    if r.get("cpu_s") is not None:
        text += f" cpu {_s(r['cpu_s'])}"
    return text if r["max_abs_diff"] <= TOLERANCE else text + f" [red]WRONG {r['max_abs_diff']:.1e}[/red]"


def report(results: dict[str, Any]) -> None:
    from rich.table import Table

    con = console()
    table = Table(title="export time, s (region calls / distinct subgraphs in the program); ratio = peer / stampout")
    table.add_column("layers", justify="right")
    for v in EXPORT_VARIANTS:
        table.add_column(LABELS[v], justify="right")
    for v in EXPORT_VARIANTS[1:]:
        table.add_column(f"{LABELS[v]} ratio", justify="right")
    for layers, row in results["export"].items():
        table.add_row(layers, *[_cell_text(row[v]) for v in EXPORT_VARIANTS],
                      *[_ratio(row[v], row["stampout"]) for v in EXPORT_VARIANTS[1:]])
    con.print(table)

    floor = results.get("aoti_floor", {}).get("median_s")
    table = Table(title="aoti_compile_and_package, s (region calls / subgraphs / Inductor subgraph lowerings); "
                  f"ratio = peer / stampout. A one-Linear module takes {_s(floor)} s: most of each cell is "
                  "AOTInductor's fixed cost (C++ toolchain, headers), and cells vary by seconds on a shared machine")
    table.add_column("layers", justify="right")
    for v in AOTI_VARIANTS:
        table.add_column(LABELS[v], justify="right")
    for v in AOTI_VARIANTS[1:]:
        table.add_column(f"{LABELS[v]} ratio", justify="right")
    for layers, row in results["aoti"].items():
        table.add_row(layers, *[_cell_text(row[v]) for v in AOTI_VARIANTS],
                      *[f"{_ratio(row[v], row['stampout'])} (cpu {_ratio(row[v], row['stampout'], 'cpu_s')})"
                        for v in AOTI_VARIANTS[1:]])
    con.print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--export-layers", type=int, nargs="*", default=[8, 32])
    p.add_argument("--aoti-layers", type=int, nargs="*", default=[16])
    p.add_argument("--repeat", type=int, default=3, help="export runs per cell (the median is reported)")
    p.add_argument("--aoti-repeat", type=int, default=3, help="AOTInductor rounds (the median is reported)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads in each worker")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per worker")
    p.add_argument("--quick", action="store_true", help="2 layers each, one export run")
    p.add_argument("--no-floor", action="store_true", help="skip measuring AOTInductor's fixed cost")
    p.add_argument("--out", default=os.path.join(_HERE, "out", "export.json"))
    p.add_argument("--worker", nargs=3, metavar=("KIND", "VARIANT", "LAYERS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        kind, variant, layers = args.worker
        try:
            result = worker(kind, variant, int(layers), args.repeat, args.threads)
        except Exception as e:  # noqa: BLE001 - a failing variant is a result (torch nested on 2.13), not a crash
            result = {"median_s": None, "error": short_error(e), "traceback": traceback.format_exc(limit=8)}
        print(json.dumps(result, default=str))
        return 0
    if args.quick:
        args.export_layers, args.aoti_layers, args.repeat, args.aoti_repeat = [2], [2], 1, 1

    t_start = time.perf_counter()
    results: dict[str, Any] = {"environment": environment(), "export": {}, "aoti": {}}
    for layers in args.export_layers:
        results["export"][str(layers)] = {v: _cell("export", v, layers, args) for v in EXPORT_VARIANTS}
    if args.aoti_layers and not args.no_floor:  # the least of two: the machine's noise only adds
        floors = [_cell("aoti", "floor", 0, args) for _ in range(2)]
        results["aoti_floor"] = min(floors, key=lambda r: r.get("median_s") or float("inf"))
    for layers in args.aoti_layers:
        rounds = [{v: _cell("aoti", v, layers, args) for v in AOTI_VARIANTS} for _ in range(args.aoti_repeat)]
        results["aoti"][str(layers)] = {v: _rounds([r[v] for r in rounds]) for v in AOTI_VARIANTS}
    results["total_s"] = time.perf_counter() - t_start
    report(results)
    return finish(args.out, results)


if __name__ == "__main__":
    sys.exit(main())
