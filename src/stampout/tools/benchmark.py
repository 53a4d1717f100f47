"""`stampout bench`: capture time vs depth, stampout side by side with torch.compile's Dynamo and torch.export.

For each model, depth and variant: the median over `repeat` runs, each on a freshly built model with every
cache reset (`stampout.reset()`, `torch._dynamo.reset()`), after one untimed warm-up run of the same
variant at the smallest depth (imports and one-time setup are not what we measure). By default each
(model, variant) pair runs in its own interpreter, so nothing one variant leaves behind (Dynamo's caches,
a failed capture's state, warmed-up code paths) changes another's times.

Models: llama-like (stampout's zoo), user (a decoder defined in a user file, bench/user_model.py of a
checkout: its code is guarded as a user's is), hf-llama and hf-gpt2 (transformers, small configs).

Variants (what is timed):
  stampout_regions  `stampout.capture(model, ...)`, decoder layers marked with `stampout.region`
  stampout_flat     `stampout.capture(model, ...)`, nothing marked
  dynamo_flat       `torch.compile(model, backend=<returns gm.forward>, fullgraph=True)` first call
  dynamo_nested     same, layers' forward wrapped in `torch.compiler.nested_compile_region`
  export            `torch.export.export(model, args, kwargs, strict=False)`, nothing marked
For Dynamo the time compared is its capture alone (`compile_inner` in Dynamo's own metrics), not the eager
run of the first call, which is kept as `first_call_s`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from .. import torch_internals
from .choices import BENCH_MODELS as MODELS

VARIANTS = ("stampout_regions", "stampout_flat", "dynamo_flat", "dynamo_nested", "export")
LABELS = {
    "stampout_regions": "stampout regions",
    "stampout_flat": "stampout flat",
    "dynamo_flat": "dynamo flat",
    "dynamo_nested": "dynamo nested",
    "export": "export",
}
RATIOS = (("dynamo_flat", "dynamo flat / regions"), ("dynamo_nested", "nested / regions"),
          ("export", "export / regions"))
MARKING = {"stampout_regions": "stampout", "stampout_flat": None, "dynamo_flat": None,
           "dynamo_nested": "nested", "export": None}
Step = Callable[[str], None]


# ------------------------------------------------------------------------------------------- models


def build(model: str, depth: int, variant: str) -> tuple[torch.nn.Module, tuple, dict]:
    """A fresh `model` with `depth` decoder layers marked as `variant` needs, and its inputs."""
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if model == "llama-like":
            from .models import LlamaConfig, LlamaLike

            # Class-level marking (the zoo's region classes): Dynamo in
            # torch 2.13 feeds every layer the first layer's weights when the forward is rebound per instance.
            regions = {"stampout": True, "nested": "nested"}.get(MARKING[variant], False)
            return LlamaLike(LlamaConfig(layers=depth), regions=regions, seed=None).eval(), (ids,), {}
        if model == "user":  # a decoder defined in a user file (guarded as a user's model is), class-level marking
            regions = {"stampout": True, "nested": "nested"}.get(MARKING[variant], False)
            return _user_model().Decoder(depth, regions=regions).eval(), (ids,), {}
        import transformers

        if model == "hf-llama":
            cfg = transformers.LlamaConfig(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=depth,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
            module = transformers.LlamaForCausalLM(cfg).eval()
            layers = module.model.layers
        elif model == "hf-gpt2":
            cfg = transformers.GPT2Config(n_layer=depth, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
            module = transformers.GPT2LMHeadModel(cfg).eval()
            layers = module.transformer.h
        else:
            raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
    return _mark(module, layers, variant), (), {"input_ids": ids, "use_cache": False}


def _user_model() -> types.ModuleType:
    """bench/user_model.py of this checkout, imported as a user's file is (not part of the installed package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "bench", "user_model.py")
    if not os.path.exists(path):
        raise FileNotFoundError(f"the user model needs a checkout of stampout: {os.path.normpath(path)} is missing")
    name = "stampout_bench_user_model"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _mark(module: torch.nn.Module, layers: torch.nn.ModuleList, variant: str) -> torch.nn.Module:
    marking = MARKING[variant]
    for layer in layers:
        if marking == "stampout":
            import stampout

            stampout.region(layer)
        elif marking == "nested":
            forward = torch.compiler.nested_compile_region(type(layer).forward)
            layer.forward = types.MethodType(forward, layer)
    return module


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, (tuple, list)) else out


def _max_diff(actual: Any, expected: Any) -> float:
    return (_logits(actual).detach().float() - _logits(expected).detach().float()).abs().max().item()


# -------------------------------------------------------------------------------------------- timing


def _reset() -> None:
    import stampout

    stampout.reset()
    torch_internals.dynamo_reset()
    gc.collect()


def time_once(model: str, variant: str, depth: int) -> dict[str, Any]:
    """Build a fresh model, reset every cache, time one capture; then check its result against eager."""
    module, args, kwargs = build(model, depth, variant)
    _reset()
    row: dict[str, Any] = {}
    if variant.startswith("stampout"):
        import stampout

        t0 = time.perf_counter()
        cap = stampout.capture(module, *args, **kwargs)
        row["time_s"] = time.perf_counter() - t0
        row.update({k: getattr(cap.stats, k) for k in ("traces", "reuses", "dedups", "subgraphs")})
        run: Callable[[], Any] = lambda: cap(*args, **kwargs)  # noqa: E731
    elif variant.startswith("dynamo"):
        from ..torch_internals import compilation_time_metrics

        graphs: list[torch.fx.GraphModule] = []

        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            graphs.append(gm)
            return gm.forward

        compilation_time_metrics.clear()
        t0 = time.perf_counter()
        out = torch.compile(module, backend=backend, fullgraph=True)(*args, **kwargs)
        row["first_call_s"] = time.perf_counter() - t0
        row["time_s"] = sum(compilation_time_metrics.get("_compile.compile_inner", [])) or row["first_call_s"]
        row["graphs"] = len(graphs)
        run = lambda: out  # noqa: E731
    else:
        t0 = time.perf_counter()
        program = torch.export.export(module, args, kwargs, strict=False)
        row["time_s"] = time.perf_counter() - t0
        run = lambda: program.module()(*args, **kwargs)  # noqa: E731
    try:
        with torch.no_grad():
            row["max_abs_diff"] = _max_diff(run(), module(*args, **kwargs))
    except Exception as e:  # noqa: BLE001 - the capture worked; its result could not be checked
        row["max_abs_diff"], row["check_error"] = None, _error(e)
    return row


def _error(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:200]


def measure(model: str, variant: str, depths: list[int], repeat: int) -> list[dict[str, Any]]:
    """One row per depth: median time over `repeat` fresh runs, after one warm-up at the smallest depth."""
    with contextlib.suppress(Exception):
        time_once(model, variant, min(depths))
    rows = []
    for depth in depths:
        row: dict[str, Any] = {"model": model, "variant": variant, "depth": depth, "times_s": [], "error": None}
        for _ in range(repeat):
            try:
                facts = time_once(model, variant, depth)
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result, recorded and shown
                row["error"] = _error(e)
                break
            row["times_s"].append(facts.pop("time_s"))
            if "first_call_s" in facts:
                row.setdefault("first_calls_s", []).append(facts.pop("first_call_s"))
            row.update(facts)
        row["median_s"] = statistics.median(row["times_s"]) if row["times_s"] and not row["error"] else None
        rows.append(row)
    _reset()
    return rows


def worker_main(spec: str) -> int:
    """Entry point of an isolated worker: measure one (model, variant); rows as JSON on stdout's last line."""
    s = json.loads(spec)
    rows = measure(s["model"], s["variant"], s["depths"], s["repeat"])
    sys.stdout.write("\n" + json.dumps(rows, default=str) + "\n")
    return 0


def measure_isolated(model: str, variant: str, depths: list[int], repeat: int,
                     timeout_s: float = 900) -> list[dict[str, Any]]:
    """`measure` in a fresh interpreter; a crash or timeout becomes an error row for every depth."""
    spec = json.dumps({"model": model, "variant": variant, "depths": depths, "repeat": repeat})
    code = "import sys; from stampout.tools.benchmark import worker_main; sys.exit(worker_main(sys.argv[1]))"
    try:
        proc = subprocess.run([sys.executable, "-c", code, spec], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        error = f"worker timed out after {timeout_s:.0f}s"
    except (IndexError, json.JSONDecodeError):
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        error = f"worker exited {proc.returncode}: {tail[-1] if tail else ''}"[:200]
    return [{"model": model, "variant": variant, "depth": d, "times_s": [], "median_s": None, "error": error}
            for d in depths]


def machine() -> dict[str, Any]:
    """Where the numbers were taken."""
    info: dict[str, Any] = {"platform": platform.platform(), "machine": platform.machine(),
                            "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                            "python": platform.python_version(), "torch": torch.__version__}
    with contextlib.suppress(ImportError):
        import transformers

        info["transformers"] = transformers.__version__
    return info


def run(models: list[str], depths: list[int], repeat: int, isolate: bool = True,
        step: Step = lambda msg: None) -> dict[str, Any]:
    """Measure every (model, variant, depth). Returns the raw results: machine, settings, rows, per-layer costs."""
    depths = sorted(set(depths))
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for model in models:
        for variant in VARIANTS:
            step(f"{model}: {LABELS[variant]} at depths {', '.join(map(str, depths))}")
            rows += (measure_isolated if isolate else measure)(model, variant, depths, repeat)
    per_layer = {m: {v: per_layer_cost(rows, m, v) for v in VARIANTS} for m in models}
    return {"bench": "stampout bench: capture time vs depth", "machine": machine(),
            "settings": {"models": models, "depths": depths, "repeat": repeat,
                         "isolation": "subprocess per (model, variant)" if isolate else "in process"},
            "total_s": time.perf_counter() - t0, "rows": rows, "per_layer_s": per_layer}


# ------------------------------------------------------------------------------------------- results


def _median(rows: list[dict[str, Any]], model: str, variant: str, depth: int) -> float | None:
    for r in rows:
        if (r["model"], r["variant"], r["depth"]) == (model, variant, depth):
            return r.get("median_s")
    return None


def per_layer_cost(rows: list[dict[str, Any]], model: str, variant: str) -> float | None:
    """(t(Nmax) - t(Nmin)) / (Nmax - Nmin) in seconds: the cost of each added layer."""
    depths = sorted({r["depth"] for r in rows if r["model"] == model and r["variant"] == variant})
    if len(depths) < 2:
        return None
    lo, hi = _median(rows, model, variant, depths[0]), _median(rows, model, variant, depths[-1])
    return None if lo is None or hi is None else (hi - lo) / (depths[-1] - depths[0])


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.1f}"


def _ratio(num: float | None, den: float | None) -> str:
    return "-" if num is None or den is None or den <= 0 else f"{num / den:.1f}x"


def table(results: dict[str, Any]) -> Any:
    """The results as a rich Table: one row per (model, depth)."""
    from rich.table import Table

    rows, settings = results["rows"], results["settings"]
    t = Table(title=f"capture time, median of {settings['repeat']} (ms)",
              caption="dynamo: capture only (compile_inner), without the eager run of its first call")
    for name in ["model", "depth", *(LABELS[v].replace(" ", "\n") for v in VARIANTS),
                 *(label.replace(" / ", "\n/ ") for _, label in RATIOS), "regions\ntraces/\nreuses", "max\n|diff|"]:
        t.add_column(name, justify="left" if name == "model" else "right")
    for model in settings["models"]:
        for depth in settings["depths"]:
            by_variant = {r["variant"]: r for r in rows if r["model"] == model and r["depth"] == depth}
            cells = [("[red]error[/red]" if r.get("error") else _ms(r.get("median_s")))
                     if (r := by_variant.get(v)) else "-" for v in VARIANTS]
            base = by_variant.get("stampout_regions", {}).get("median_s")
            ratios = [_ratio(by_variant.get(v, {}).get("median_s"), base) for v, _ in RATIOS]
            regions = by_variant.get("stampout_regions", {})
            counts = f"{regions['traces']}/{regions['reuses']}" if "traces" in regions else "-"
            diffs = [r["max_abs_diff"] for r in by_variant.values() if r.get("max_abs_diff") is not None]
            t.add_row(model, str(depth), *cells, *ratios, counts, f"{max(diffs):.1e}" if diffs else "-")
    return t


def per_layer_table(results: dict[str, Any]) -> Any:
    """Cost of each added layer, (t(Nmax) - t(Nmin)) / (Nmax - Nmin), per model and variant."""
    from rich.table import Table

    depths = results["settings"]["depths"]
    t = Table(title=f"ms per added layer (depth {depths[0]} -> {depths[-1]})")
    t.add_column("model")
    for v in VARIANTS:
        t.add_column(LABELS[v], justify="right")
    for model, costs in results["per_layer_s"].items():
        t.add_row(model, *(f"{c * 1e3:.2f}" if c is not None else "-" for c in costs.values()))
    return t


def problems(results: dict[str, Any], tolerance: float = 1e-4) -> list[str]:
    """One line per failed (model, variant, depth), or one whose result is not within `tolerance` of eager."""
    lines = []
    for r in results["rows"]:
        where = f"{r['model']} {LABELS[r['variant']]} depth {r['depth']}"
        if r.get("error"):
            lines.append(f"{where} failed: {r['error']}")
        elif r.get("check_error"):
            lines.append(f"{where}: could not run the result to compare with eager: {r['check_error']}")
        elif r.get("max_abs_diff") is not None and r["max_abs_diff"] > tolerance:
            lines.append(f"{where}: result differs from eager by {r['max_abs_diff']:.2e}")
    return lines


def plot(results: dict[str, Any], path: str) -> None:
    """Capture time vs depth, log-scale y, one line per variant, one subplot per model, as a PNG."""
    from matplotlib.figure import Figure

    models = results["settings"]["models"]
    fig = Figure(figsize=(5 * len(models), 4), layout="constrained")
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, model in zip(axes, models):
        for v in VARIANTS:
            points = [(r["depth"], r["median_s"] * 1e3) for r in results["rows"]
                      if r["model"] == model and r["variant"] == v and r.get("median_s")]
            if points:
                ax.plot(*zip(*sorted(points)), marker="o", label=LABELS[v])
        ax.set_xscale("log", base=2)
        ax.set_xticks(results["settings"]["depths"], [str(d) for d in results["settings"]["depths"]])
        ax.set_yscale("log")
        ax.set_title(model)
        ax.set_xlabel("decoder layers")
        ax.set_ylabel("capture time (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"capture time vs depth ({results['machine']['cpus']} CPUs, torch {results['machine']['torch']})")
    fig.savefig(path, dpi=110)


def write(results: dict[str, Any], out_dir: str) -> tuple[str, str]:
    """Write `capture_vs_depth.json` and `capture_vs_depth.png` to `out_dir`; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    json_path, png_path = (os.path.join(out_dir, f"capture_vs_depth.{ext}") for ext in ("json", "png"))
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    plot(results, png_path)
    return json_path, png_path
