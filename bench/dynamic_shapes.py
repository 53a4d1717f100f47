"""Dynamic shapes with Inductor: one model, inference over 8 sequence lengths, from the compile call to the
last result — stampout (dynamic=None: static first, one symbolic capture after the first size change) vs
torch.compile + nested_compile_region vs torch.compile flat (both with their default automatic dynamic).

    python bench/dynamic_shapes.py                 # LlamaLike(layers=16), ids [2, T] for 8 lengths
    python bench/dynamic_shapes.py --layers 4 --lengths 8 12 5

Each variant runs in a fresh interpreter with a new, empty TORCHINDUCTOR_CACHE_DIR; imports, the model and an
eager reference happen before the clock. The cell records the total time, the time per call, the number of
captures (stampout) / frame compiles (torch), and the worst |out - eager| over the calls. Ratios are stampout /
peer from the same run (the target: <= 0.8 against torch nested). Raw numbers: bench/out/dynamic_shapes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.common import console, environment, finish, fmt_ratio, run_cold_cell  # noqa: E402

VARIANTS = ("stampout", "torch_nested", "torch_flat")
LENGTHS = (8, 12, 16, 24, 32, 40, 48, 64)


def run_cell(cell: dict[str, Any]) -> dict[str, Any]:
    import torch

    import stampout
    from stampout.tools.models import make_input, make_model

    torch.set_num_threads(cell["threads"])
    variant = cell["variant"]
    regions = {"stampout": True, "torch_nested": "nested", "torch_flat": False}[variant]
    model = make_model("llama", regions=regions, layers=cell["layers"], hidden=cell["hidden"],
                       intermediate=2 * cell["hidden"], heads=8, kv_heads=4).eval()
    inputs = [make_input("llama", seq=t, model=model, seed=i)[0] for i, t in enumerate(cell["lengths"])]
    with torch.no_grad():
        expected = [model(ids) for ids in inputs]
    started = time.perf_counter()
    fn = stampout.compile(model, backend="inductor") if variant == "stampout" else torch.compile(model)
    calls, errors = [], []
    with torch.no_grad():
        for ids, ref in zip(inputs, expected):
            t0 = time.perf_counter()
            out = fn(ids)
            calls.append(time.perf_counter() - t0)
            errors.append((out - ref).abs().max().item())
    total = time.perf_counter() - started
    if variant == "stampout":
        captures = fn.stats.captures
    else:
        from torch._dynamo.utils import counters

        captures = counters["stats"]["unique_graphs"]
    return {"total_s": total, "calls_s": calls, "captures": captures, "max_err": max(errors)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(run_cell(json.loads(args.worker))))
        return 0
    started = time.perf_counter()
    rows: dict[str, Any] = {}
    for variant in args.variants:
        cell = {"variant": variant, "layers": args.layers, "hidden": args.hidden, "lengths": args.lengths,
                "threads": args.threads}
        rows[variant] = run_cold_cell(__file__, cell)
        print(variant, json.dumps(rows[variant])[:300], flush=True)
    from rich.table import Table

    table = Table(title=f"LlamaLike(layers={args.layers}, hidden={args.hidden}), Inductor, inference over "
                        f"{len(args.lengths)} lengths {args.lengths}, cold")
    for column in ("variant", "total s", "first call s", "later calls ms (median)", "captures", "max err",
                   "stampout / this"):
        table.add_column(column)
    ours = rows.get("stampout", {}).get("total_s")
    for variant, row in rows.items():
        if "total_s" not in row:
            table.add_row(variant, row.get("error", "?"), "", "", "", "", "")
            continue
        later = sorted(row["calls_s"][2:]) or [0.0]
        table.add_row(variant, f"{row['total_s']:.1f}", f"{row['calls_s'][0]:.1f}",
                      f"{later[len(later) // 2] * 1e3:.1f}", str(row["captures"]), f"{row['max_err']:.1e}",
                      fmt_ratio(ours, row["total_s"]))
    console().print(table)
    payload = {"environment": environment(), "args": vars(args), "rows": rows,
               "total_s": time.perf_counter() - started}
    return finish(os.path.join(_HERE, "out", "dynamic_shapes.json"), payload)


if __name__ == "__main__":
    sys.exit(main())
