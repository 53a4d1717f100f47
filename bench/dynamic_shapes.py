"""Dynamic shapes with Inductor: one model, inference over 8 sequence lengths, from the compile call to the
last result — stampout (dynamic=None: static first, one symbolic capture after the first size change) vs
torch.compile + nested_compile_region vs torch.compile flat (both with their default automatic dynamic).

    python bench/dynamic_shapes.py                 # LlamaLike(layers=16), ids [2, T] for 8 lengths
    python bench/dynamic_shapes.py --layers 4 --lengths 8 12 5 --models llama user hf-llama

Models: LlamaLike, a decoder defined in a user file (bench/user_model.py) and transformers' Llama (``--models``).
Each variant runs in a fresh interpreter with a new, empty TORCHINDUCTOR_CACHE_DIR; imports, the model and an
eager reference happen before the clock. The cell records the total time, the time per call and its CPU time
(the process's threads and finished children: the C++ compiler), the number of captures (stampout) / frame
compiles (torch), and the worst |out - eager| over the calls; for stampout also how long after the last call its
background compile of the new length (backends/background.py) was done (``ready s``: until then, calls run the
captured graph eagerly). Ratios are stampout / peer from the same run (the target: <= 0.8 against torch nested);
"new length / first" is the second call (the first at a new length) over the first call (issue 21: <= 0.2).
``--base-src DIR`` adds ``stampout@base``, stampout imported from another tree's src (a ``git worktree`` of main),
in the same run. Raw numbers: bench/out/dynamic_shapes.json.
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

from bench.common import USER_AND_HF, console, environment, finish, fmt_ratio, run_cold_cell, user_or_hf_model  # noqa: E402,E501

VARIANTS = ("stampout", "torch_nested", "torch_flat")
BASE = "stampout@base"  # stampout from --base-src
LENGTHS = (8, 12, 16, 24, 32, 40, 48, 64)


def _logits(out: Any) -> Any:
    return getattr(out, "logits", out)  # a transformers ModelOutput: its logits


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_cell(cell: dict[str, Any]) -> dict[str, Any]:
    import torch

    import stampout
    from stampout.tools.models import make_input, make_model

    torch.set_num_threads(cell["threads"])
    variant, name = cell["variant"], cell.get("model", "llama")
    if name == "llama":
        regions = {"stampout": True, "torch_nested": "nested", "torch_flat": False}[variant]
        model = make_model("llama", regions=regions, layers=cell["layers"], hidden=cell["hidden"],
                           intermediate=2 * cell["hidden"], heads=8, kv_heads=4).eval()
        calls = [((make_input("llama", seq=t, model=model, seed=i)[0],), {}) for i, t in enumerate(cell["lengths"])]
    else:  # a decoder defined in a user file, transformers' Llama (small configs, as stampout bench builds them)
        model, _, kwargs = user_or_hf_model(name, cell["layers"], variant)
        ids = [torch.randint(0, 128, (2, t), generator=torch.Generator().manual_seed(i))
               for i, t in enumerate(cell["lengths"])]
        calls = [((x,), {}) if name == "user" else ((), {**kwargs, "input_ids": x}) for x in ids]
    with torch.no_grad():
        expected = [_logits(model(*a, **k)) for a, k in calls]
    started = time.perf_counter()
    fn = stampout.compile(model, backend="inductor") if variant == "stampout" else torch.compile(model)
    calls_s, cpu_s, errors = [], [], []
    with torch.no_grad():
        for (a, k), ref in zip(calls, expected):
            t0, c0 = time.perf_counter(), _cpu()
            out = _logits(fn(*a, **k))
            calls_s.append(time.perf_counter() - t0)
            cpu_s.append(_cpu() - c0)
            errors.append((out - ref).abs().max().item())
    total = time.perf_counter() - started
    t0 = time.perf_counter()
    if variant == "stampout":
        try:
            from stampout.backends import background
        except ImportError:  # (a tree before background compiles)
            background = None
        if background is not None:
            background.wait_all()
    if variant == "stampout":
        captures = fn.stats.captures
    else:
        from torch._dynamo.utils import counters

        captures = counters["stats"]["unique_graphs"]
    return {"total_s": total, "calls_s": calls_s, "cpu_s": cpu_s, "ready_s": time.perf_counter() - t0,
            "captures": captures, "max_err": max(errors)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=("llama", *USER_AND_HF), default=["llama", *USER_AND_HF],
                   help="LlamaLike (hidden --hidden), a decoder defined in a user file, transformers' Llama")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--base-src", help="also stampout imported from this tree's src (before/after in one run)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(run_cell(json.loads(args.worker))))
        return 0
    started = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    for model in args.models:
        rows[model] = {}
        for variant in [*args.variants, *([BASE] if args.base_src else [])]:
            cell = {"model": model, "variant": "stampout" if variant == BASE else variant, "layers": args.layers,
                    "hidden": args.hidden, "lengths": args.lengths, "threads": args.threads}
            rows[model][variant] = run_cold_cell(__file__, cell, src=args.base_src if variant == BASE else None)
            print(model, variant, json.dumps(rows[model][variant])[:300], flush=True)
    from rich.table import Table

    table = Table(title=f"{args.layers} layers (LlamaLike hidden {args.hidden}; user and HF hidden 64), Inductor, "
                        f"inference over {len(args.lengths)} lengths {args.lengths}, cold",
                  caption="new length: the second call (the first new length: stampout's symbolic recapture and "
                          "compile) / the first call (issue 21's target: <= 0.2)")
    for column in ("model", "variant", "total s", "first call s", "new length s", "new length / first",
                   "new length cpu / first cpu", "ready s", "later calls ms (median)", "captures", "max err",
                   "stampout / this"):
        table.add_column(column)
    for model, by_variant in rows.items():
        ours = by_variant.get("stampout", {}).get("total_s")
        for variant, row in by_variant.items():
            if "total_s" not in row:
                table.add_row(model, variant, row.get("error", "?"), *[""] * 9)
                continue
            calls = row["calls_s"]
            later = sorted(calls[2:]) or [0.0]
            second = calls[1] if len(calls) > 1 else None
            table.add_row(model, variant, f"{row['total_s']:.1f}", f"{calls[0]:.1f}",
                          "-" if second is None else f"{second:.2f}", fmt_ratio(second, calls[0]),
                          fmt_ratio(row["cpu_s"][1], row["cpu_s"][0]) if second is not None else "-",
                          f"{row['ready_s']:.1f}",
                          f"{later[len(later) // 2] * 1e3:.1f}", str(row["captures"]), f"{row['max_err']:.1e}",
                          fmt_ratio(ours, row["total_s"]))
    console().print(table)
    payload = {"environment": environment(), "args": vars(args), "rows": rows,
               "total_s": time.perf_counter() - started}
    return finish(os.path.join(_HERE, "out", "dynamic_shapes.json"), payload)


if __name__ == "__main__":
    sys.exit(main())
