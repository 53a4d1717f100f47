"""First-call latency with Inductor on CPU: stampout vs torch.compile, flat and with nested regions.

    python bench/first_call.py --layers 8 32 --modes inference training
    python bench/first_call.py --quick            # 2 layers, inference only

For each depth N (``LlamaLike(layers=N)``, ids [2, 16]), mode and variant, the time from calling the
compiler until the first result is ready:

  stampout      stampout.compile(model, backend="inductor")(ids)          forward = stampout.region
  torch nested  torch.compile(model, backend="inductor")(ids)             nested_compile_region
  torch flat    torch.compile(model, backend="inductor")(ids)             plain DecoderLayer

``inference``: under ``torch.no_grad()``, until the output is returned. ``training``: grad enabled,
forward and ``loss = out.float().pow(2).mean(); loss.backward()``, until backward is done.

Every (depth, mode, variant) runs in a fresh interpreter with a private, fresh Inductor cache
(``TORCHINDUCTOR_CACHE_DIR`` = a new temporary directory, FX graph cache and AOTAutograd cache off), so
no variant gains from another's compiled artifacts. Before the clock starts each worker imports
torch._dynamo and torch._inductor.compile_fx and runs the model once eagerly (the reference values), so
import time and eager warm-up are not counted. Intra-op threads default to 1 (``--threads``): on a
shared 2-core machine OpenMP with 2 threads stalls whenever another process holds a core.

The fixed cost of any first Inductor compile in a fresh process and cache (its one-time setup: worker
pool, C++ prefix headers...) is measured per mode on a 3-op function and reported beside the ratios,
which are also given with it subtracted from both sides (``--no-floor`` skips it).

Correctness is recorded for every variant: max |out - eager out|, and in training, per parameter
max |grad - eager grad| and ||grad - eager grad|| / ||eager grad|| (the worst parameter is named).
Raw numbers go to bench/out/first_call.json. Timings on a shared 2-core machine are noisy.
"""

from __future__ import annotations

import argparse
import importlib
import os
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

from bench.common import console, environment, finish, run_json_worker, short_error  # noqa: E402
from stampout.models import LlamaConfig, LlamaLike  # noqa: E402

VARIANTS = ("stampout", "torch_nested", "torch_flat")
LABELS = {"stampout": "stampout", "torch_nested": "torch nested", "torch_flat": "torch flat"}
REGIONS: dict[str, bool | str] = {"stampout": True, "torch_nested": "nested", "torch_flat": False}
MODES = ("inference", "training")
INPUT_SHAPE = (2, 16)
OUT_TOL = 1e-3  # max abs difference of logits vs eager
GRAD_TOL = 1e-3  # relative (norm) error of each parameter's gradient vs eager


# ---------------------------------------------------------------------------------------- worker


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def _grad_errors(got: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor | None]) -> dict[str, Any]:
    max_abs, max_rel, worst, missing = 0.0, 0.0, None, []
    for name, r in ref.items():
        g = got.get(name)
        if r is None:
            continue
        if g is None:
            missing.append(name)
            continue
        d = (g - r).abs().max().item()
        rel = ((g - r).norm() / r.norm().clamp_min(1e-12)).item()
        max_abs = max(max_abs, d)
        if rel > max_rel:
            max_rel, worst = rel, name
    return {
        "grad_max_abs_diff": max_abs,
        "grad_max_rel_err": max_rel,
        "grad_worst_param": worst,
        "grads_missing": missing[:5],
        "grads_missing_count": len(missing),
    }


def run_floor(mode: str, threads: int) -> dict[str, Any]:
    """The fixed cost of a first Inductor compile in a fresh process and cache: a 3-op function."""
    torch.set_num_threads(threads)
    for mod in ("torch._dynamo", "torch._inductor.compile_fx"):
        importlib.import_module(mod)
    training = mode == "training"
    w = torch.randn(16, 16, requires_grad=training)
    x = torch.randn(4, 16)

    def tiny(x: torch.Tensor) -> torch.Tensor:
        return (x @ w).sin() * 2

    t0 = time.perf_counter()
    fn = torch.compile(tiny, backend="inductor")
    if training:
        _loss(fn(x)).backward()
    else:
        with torch.no_grad():
            fn(x)
    return {"first_call_s": time.perf_counter() - t0, "error": None}


def run_variant(variant: str, layers: int, mode: str, threads: int) -> dict[str, Any]:
    """One measurement in this (fresh) process. Returns the raw facts."""
    if variant == "floor":
        return run_floor(mode, threads)
    torch.set_num_threads(threads)
    t_imp = time.perf_counter()
    for mod in ("torch._dynamo", "torch._inductor.compile_fx", "stampout"):  # import time is not measured
        importlib.import_module(mod)
    import stampout

    import_s = time.perf_counter() - t_imp
    training = mode == "training"
    ids = torch.randint(0, LlamaConfig().vocab, INPUT_SHAPE, generator=torch.Generator().manual_seed(0))
    model = LlamaLike(LlamaConfig(layers=layers), regions=REGIONS[variant], seed=0)
    model.requires_grad_(training)

    # Eager reference (and warm-up of the eager kernels), before the clock starts.
    if training:
        ref_out = model(ids)
        _loss(ref_out).backward()
        ref_grads = _grads(model)
        model.zero_grad(set_to_none=True)
        ref_out = ref_out.detach()
    else:
        with torch.no_grad():
            ref_out = model(ids)
        ref_grads = {}

    r: dict[str, Any] = {"import_s": import_s, "threads": torch.get_num_threads()}
    t0 = time.perf_counter()
    if variant == "stampout":
        fn = stampout.compile(model, backend="inductor")
    else:
        fn = torch.compile(model, backend="inductor")
    if training:
        out = fn(ids)
        t_fwd = time.perf_counter()
        _loss(out).backward()
    else:
        with torch.no_grad():
            out = fn(ids)
        t_fwd = time.perf_counter()
    t1 = time.perf_counter()
    r["first_call_s"] = t1 - t0
    r["first_forward_s"] = t_fwd - t0
    if training:
        r["first_backward_s"] = t1 - t_fwd

    r["out_max_abs_diff"] = (out.detach().float() - ref_out.float()).abs().max().item()
    if training:
        r.update(_grad_errors(_grads(model), ref_grads))
        model.zero_grad(set_to_none=True)
    ok = r["out_max_abs_diff"] <= OUT_TOL
    if training:
        ok = ok and r["grad_max_rel_err"] <= GRAD_TOL and r["grads_missing_count"] == 0
    r["correct"] = ok

    # One more step: steady-state time (no compile), for scale.
    t2 = time.perf_counter()
    if training:
        _loss(fn(ids)).backward()
    else:
        with torch.no_grad():
            fn(ids)
    r["second_call_s"] = time.perf_counter() - t2

    if variant == "stampout":
        r["captures"] = fn.stats.captures
        r["traces"] = fn.stats.traces
    else:
        from torch._dynamo.utils import counters

        r["dynamo_unique_graphs"] = counters["stats"].get("unique_graphs")
    r["inductor_cache_dir"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    r["error"] = None
    return r


# ---------------------------------------------------------------------------------------- parent


def _fresh_cache_env(cache_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        TORCHINDUCTOR_CACHE_DIR=cache_dir,
        TORCHINDUCTOR_FX_GRAPH_CACHE="0",
        TORCHINDUCTOR_AUTOGRAD_CACHE="0",
        TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE="0",
        TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE="0",
        TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"),
    )
    return env


def _run_worker(variant: str, layers: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    cache_dir = tempfile.mkdtemp(prefix=f"stampout_fc_{variant}_{layers}_{mode}_")
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        variant,
        "--layers",
        str(layers),
        "--modes",
        mode,
        "--threads",
        str(args.threads),
    ]
    t0 = time.perf_counter()
    try:
        res, err = run_json_worker(cmd, timeout=args.timeout, env=_fresh_cache_env(cache_dir))
    finally:
        if not args.keep_cache:
            shutil.rmtree(cache_dir, ignore_errors=True)
    wall = time.perf_counter() - t0
    out = res if err is None else {"first_call_s": None, **err}
    out["worker_wall_s"] = wall
    return out


def _median_run(variant: str, layers: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    runs = [_run_worker(variant, layers, mode, args) for _ in range(args.repeat)]
    good = [r for r in runs if not r.get("error")]
    if not good:
        return {**runs[0], "runs": len(runs)}
    times = [r["first_call_s"] for r in good]
    best = sorted(good, key=lambda r: r["first_call_s"])[len(good) // 2]
    return {**best, "first_call_times_s": times, "median_s": statistics.median(times), "runs": len(runs)}


# ---------------------------------------------------------------------------------------- report


def _t(results: dict, v: str, key: str) -> float | None:
    r = results.get(key, {}).get(v)
    if not r or r.get("error"):
        return None
    return r.get("median_s", r.get("first_call_s"))


def _s(t: float | None) -> str:
    return "-" if t is None else f"{t:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def _floor(floors: dict[str, dict[str, Any]], key: str) -> float | None:
    r = floors.get(key.split("/")[1])
    return None if not r or r.get("error") else r.get("median_s")


def _ratio_minus(a: float | None, b: float | None, floor: float | None) -> str:
    if a is None or b is None or floor is None or b <= floor:
        return "-"
    return f"{(a - floor) / (b - floor):.2f}x"


def report(
    results: dict[str, dict[str, dict[str, Any]]],
    keys: list[str],
    variants: list[str],
    floors: dict[str, dict[str, Any]] | None = None,
) -> None:
    floors = floors or {}
    con = console()
    from rich.table import Table

    table = Table(
        title="first call with Inductor on CPU (capture + compile + first run; seconds)",
        caption="fresh process and fresh Inductor cache per cell; training = forward + backward (split in "
        "parentheses). Ratios > 1: stampout's first call is faster. fixed cost: the first call of a 3-op "
        "function in a fresh process and cache (Inductor's one-time setup), subtracted in the '− fixed' ratios.",
    )
    table.add_column("layers", justify="right")
    table.add_column("mode")
    for v in variants:
        table.add_column(LABELS[v], justify="right")
    pairs = [(a, "stampout") for a in ("torch_nested", "torch_flat") if a in variants and "stampout" in variants]
    for a, _ in pairs:
        table.add_column(f"{LABELS[a]} / stampout", justify="right")
    if floors:
        table.add_column("fixed cost", justify="right")
        for a, _ in pairs:
            table.add_column(f"{LABELS[a]} / stampout − fixed", justify="right")

    for key in keys:
        layers, mode = key.split("/")
        row = [layers, mode]
        for v in variants:
            r = results[key].get(v, {})
            if r.get("error"):
                row.append(f"[red]error: {r['error'].split(':')[0][:22]}[/red]")
                continue
            cell = _s(_t(results, v, key))
            if mode == "training" and r.get("first_backward_s") is not None:
                cell += f" ({r['first_forward_s']:.1f}+{r['first_backward_s']:.1f})"
            if r.get("correct") is False:
                cell += " [red]WRONG[/red]"
            row.append(cell)
        row += [_ratio(_t(results, a, key), _t(results, b, key)) for a, b in pairs]
        if floors:
            fl = _floor(floors, key)
            row.append(_s(fl))
            row += [_ratio_minus(_t(results, a, key), _t(results, b, key), fl) for a, b in pairs]
        table.add_row(*row)
    con.print(table)

    corr = Table(
        title="correctness vs eager (max |Δout|; training: max |Δgrad|, worst relative grad error) "
        "and the second call (ms; one sample, not a steady-state timing)"
    )
    corr.add_column("layers", justify="right")
    corr.add_column("mode")
    for v in variants:
        corr.add_column(LABELS[v], justify="right")
    for v in variants:
        corr.add_column(f"{LABELS[v]} 2nd call", justify="right")
    for key in keys:
        layers, mode = key.split("/")
        row = [layers, mode]
        for v in variants:
            r = results[key].get(v, {})
            if r.get("error") or "out_max_abs_diff" not in r:
                row.append("-")
                continue
            cell = f"out {r['out_max_abs_diff']:.1e}"
            if mode == "training":
                cell += f", grad {r['grad_max_abs_diff']:.1e}, rel {r['grad_max_rel_err']:.1e}"
                if r.get("grads_missing_count"):
                    cell += f", {r['grads_missing_count']} grads missing"
            style = "green" if r.get("correct") else "red"
            row.append(f"[{style}]{cell}[/{style}]")
        for v in variants:
            t2 = results[key].get(v, {}).get("second_call_s")
            row.append("-" if t2 is None else f"{t2 * 1e3:.1f}")
        corr.add_row(*row)
    con.print(corr)
    for key in keys:
        for v in variants:
            r = results[key].get(v, {})
            if r.get("error"):
                con.print(f"[red]{LABELS[v]} {key}:[/red] {r['error']}")
                for line in r.get("stderr_tail", [])[-6:]:
                    con.print(f"    {line}", markup=False)
            elif r.get("correct") is False and r.get("grad_worst_param"):
                con.print(
                    f"[yellow]{LABELS[v]} {key}: worst gradient {r['grad_worst_param']} "
                    f"(relative error {r['grad_max_rel_err']:.2e})[/yellow]"
                )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--repeat", type=int, default=1, help="fresh runs per cell (the median is reported)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads in each worker")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per worker")
    p.add_argument("--quick", action="store_true", help="2 layers, inference only")
    p.add_argument("--keep-cache", action="store_true", help="keep each worker's Inductor cache directory")
    p.add_argument("--out", default=os.path.join(_HERE, "out", "first_call.json"))
    p.add_argument("--no-floor", action="store_true", help="skip measuring the fixed cost (a tiny compile)")
    p.add_argument("--worker", choices=(*VARIANTS, "floor"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.modes = [2], ["inference"]
    args.layers = sorted(set(args.layers))

    if args.worker:
        import json

        try:
            res = run_variant(args.worker, args.layers[0], args.modes[0], args.threads)
        except Exception as e:  # noqa: BLE001 - stampout is a work in progress; report, don't stop
            res = {"first_call_s": None, "error": short_error(e), "traceback": traceback.format_exc(limit=10)}
        print(json.dumps(res, default=str))
        return 0

    t_start = time.perf_counter()
    keys = [f"{n}/{m}" for n in args.layers for m in MODES if m in args.modes]
    floors: dict[str, dict[str, Any]] = {}
    if not args.no_floor:
        for m in (m for m in MODES if m in args.modes):
            floors[m] = _median_run("floor", 0, m, args)
            r = floors[m]
            status = r["error"] if r.get("error") else f"{_s(r.get('median_s'))} s"
            print(f"  {'fixed cost/' + m:>22}: {status}", file=sys.stderr, flush=True)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for key in keys:
        n, m = key.split("/")
        results[key] = {}
        for v in args.variants:
            results[key][v] = _median_run(v, int(n), m, args)
            r = results[key][v]
            status = r["error"] if r.get("error") else f"{_s(_t(results, v, key))} s"
            print(f"  {key:>14} {LABELS[v]:>13}: {status}", file=sys.stderr, flush=True)
    total = time.perf_counter() - t_start
    report(results, keys, args.variants, floors)

    ratios: dict[str, dict[str, float | None]] = {}
    for key in keys:
        ts = _t(results, "stampout", key)
        ratios[key] = {}
        for a in ("torch_nested", "torch_flat"):
            if a in args.variants and "stampout" in args.variants:
                ta = _t(results, a, key)
                ratios[key][f"{a}/stampout"] = ta / ts if ta is not None and ts else None
                fl = _floor(floors, key)
                if fl is not None and ta is not None and ts is not None and ts > fl:
                    ratios[key][f"{a}/stampout minus fixed cost"] = (ta - fl) / (ts - fl)
    payload = {
        "bench": "first_call",
        "model": "LlamaLike",
        "input": list(INPUT_SHAPE),
        "layers": args.layers,
        "modes": args.modes,
        "repeat": args.repeat,
        **environment(),
        "worker_threads": args.threads,
        "total_s": total,
        "fixed_cost": floors,
        "ratios": ratios,
        "results": results,
    }
    return finish(args.out, payload)


if __name__ == "__main__":
    sys.exit(main())
