"""Per-call dispatch overhead of an already compiled model: stampout vs torch.compile.

    python bench/guard_overhead.py --layers 8 80 --models llama-like user hf-llama --calls 500 --batches 5

Models (``--models``): ``llama-like`` (the zoo's LlamaLike), ``user`` (a decoder defined in a user file,
bench/user_model.py: user code is guarded as a user's model is), ``hf-llama`` (transformers'
LlamaForCausalLM, small, ``use_cache=False``; regions marked by ``regions="auto"``, Dynamo's by wrapping
the decoder layer class's forward in ``nested_compile_region``), ``hf-decode-static`` / ``hf-decode-dynamic``
(the same Llama, one decode step: a token per sequence after a 16-token prompt held in a ``StaticCache`` /
``DynamicCache``, passed as ``past_key_values`` with ``cache_position``; after each step the dynamic cache's
tensors are put back as the prompt left them, so every step sees the same cache). Every variant compiles the
model with N layers (ids [2, 16]; a decode step: [2, 1]) with a backend that computes nothing: it
returns precomputed zero tensors, as many as the captured graph has outputs (read from the graph's
output node). What is left of a call is the guard check and the dispatch around the compiled code:

  stampout regions   stampout.compile(model, backend=noop)                      forward = stampout.region
  stampout flat      same, plain DecoderLayer                                   (not asked for: --variants)
  torch flat         torch.compile(model, backend=noop, fullgraph=True)         plain DecoderLayer
  torch nested       same, forward = torch.compiler.nested_compile_region(...)
  eager              the model itself, no compiler: the real forward, for scale (fewer calls)

For each depth and grad mode (``no_grad``: under ``torch.no_grad()``; ``grad``: grad enabled, parameters
requiring grad), a fresh model is compiled and called once, then warmed up, then timed: ``--batches``
batches of ``--calls`` calls each (GC off while timing); the reported number is the median over batches
of the per-call time. The run checks that no variant recompiled while timed (captures / backend calls).
Each variant runs in its own fresh interpreter. Raw numbers go to bench/out/guard_overhead.json.

Timings on a shared 2-core machine are noisy; compare ratios rather than absolute numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
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
from torch import fx  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from bench.common import console, environment, finish, reset_all, run_json_worker, short_error  # noqa: E402
from stampout.tools.models import LlamaConfig, LlamaLike  # noqa: E402

MODELS = ("llama-like", "user", "hf-llama", "hf-decode-static", "hf-decode-dynamic")
DECODE = ("hf-decode-static", "hf-decode-dynamic")

VARIANTS = ("stampout_regions", "stampout_flat", "torch_flat", "torch_nested", "eager")
DEFAULT_VARIANTS = ("stampout_regions", "torch_flat", "torch_nested", "eager")
LABELS = {
    "stampout_regions": "stampout regions",
    "stampout_flat": "stampout flat",
    "torch_flat": "torch flat",
    "torch_nested": "torch nested",
    "eager": "eager fwd",
}
REGIONS: dict[str, bool | str] = {
    "stampout_regions": True,
    "stampout_flat": False,
    "torch_flat": False,
    "torch_nested": "nested",
    "eager": False,
}
GRAD_MODES = ("no_grad", "grad")
INPUT_SHAPE = (2, 16)


# ---------------------------------------------------------------------------------- noop backend


def _placeholder_output(node: Any) -> Any:
    """A zero tensor with the metadata recorded on an output node (``val`` or Dynamo's ``example_value``)."""
    if not isinstance(node, fx.Node):
        return node  # a constant or None in the output
    val = node.meta.get("val", node.meta.get("example_value"))
    if isinstance(val, torch.Tensor):
        return torch.zeros(tuple(int(s) for s in val.shape), dtype=val.dtype)
    if val is None:
        raise RuntimeError(f"output node {node.name} has no recorded value")
    return val


def make_noop_backend(compiled: list[fx.GraphModule]) -> Callable:
    """A torch.compile-style backend whose compiled callable returns precomputed zeros and does nothing else.

    Every graph it is given is appended to ``compiled`` (so recompiles can be counted).
    """

    def noop_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        compiled.append(gm)
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        outs = tuple(_placeholder_output(n) for n in tree_leaves(output.args[0]))

        def run(*args: Any) -> tuple:
            return outs

        return run

    return noop_backend


# ---------------------------------------------------------------------------------------- timing


def _model(name: str, layers: int, regions: bool | str) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if name == "llama-like":
            return LlamaLike(LlamaConfig(layers=layers), regions=regions, seed=0)
        if name == "user":
            from bench.user_model import Decoder

            return Decoder(layers, regions=regions)
        import transformers
        from transformers.models.llama import modeling_llama

        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       use_cache=name in DECODE)
        model = transformers.LlamaForCausalLM(cfg).eval()
        if regions == "nested":  # class-level marking, on a subclass: other models in this process keep theirs
            for layer in model.model.layers:
                layer.__class__ = _nested_llama_layer(modeling_llama.LlamaDecoderLayer)
        return model


_NESTED: dict[type, type] = {}


def _nested_llama_layer(cls: type) -> type:
    if cls not in _NESTED:
        _NESTED[cls] = type(cls.__name__, (cls,), {"forward": torch.compiler.nested_compile_region(cls.forward)})
    return _NESTED[cls]


class DecodeStep:
    """One decode step of `fn` (the model, compiled or not) on a cache filled by a 16-token prompt: called with
    the prompt's ids, it feeds their last token at the next position; a dynamic cache's tensors are put back
    after each step, so that every step is the same call."""

    def __init__(self, fn: Callable, model: torch.nn.Module, ids: torch.Tensor, cache_kind: str) -> None:
        import transformers

        if cache_kind == "static":
            cache = transformers.StaticCache(config=model.config, max_cache_len=2 * ids.shape[1])
        else:
            cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        self.fn, self.cache = fn, cache
        self.position = torch.tensor([ids.shape[1]])
        self.kept = [(layer.keys, layer.values) for layer in cache.layers] if cache_kind == "dynamic" else None

    def __call__(self, ids: torch.Tensor) -> Any:
        out = self.fn(input_ids=ids[:, -1:], past_key_values=self.cache, cache_position=self.position,
                      use_cache=True)
        if self.kept is not None:
            for layer, (keys, values) in zip(self.cache.layers, self.kept):
                layer.keys, layer.values = keys, values
        return out


def _build(name: str, variant: str, layers: int, grad: bool) -> tuple[Callable, list[fx.GraphModule], Callable]:
    model = _model(name, layers, REGIONS[variant])
    model.requires_grad_(grad)
    compiled: list[fx.GraphModule] = []
    ids = torch.randint(0, 256, INPUT_SHAPE, generator=torch.Generator().manual_seed(0))

    def step(fn: Callable) -> Callable:
        return DecodeStep(fn, model, ids, name.rsplit("-", 1)[1]) if name in DECODE else fn

    if variant == "eager":
        return step(model), compiled, step(model)
    backend = make_noop_backend(compiled)
    if variant.startswith("stampout"):
        import stampout

        auto = "auto" if name.startswith("hf-") and REGIONS[variant] is True else None
        return step(stampout.compile(model, backend=backend, regions=auto)), compiled, step(model)
    return step(torch.compile(model, backend=backend, fullgraph=True)), compiled, step(model)


def _logits(y: Any) -> torch.Tensor:
    return y.logits if hasattr(y, "logits") else y


def _captures(fn: Any) -> int | None:
    st = getattr(getattr(fn, "fn", fn), "stats", None)
    return getattr(st, "captures", None)


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
_clock = [time.perf_counter]  # set by --clock (the thread's CPU time: other processes' load does not count)


def _time_batches(fn: Callable, ids: torch.Tensor, calls: int, batches: int) -> list[float]:
    """Per-call seconds of each batch (GC disabled while timing), by the clock --clock chose."""
    clock = _clock[0]
    out: list[float] = []
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(batches):
            t0 = clock()
            for _ in range(calls):
                fn(ids)
            out.append((clock() - t0) / calls)
    finally:
        if gc_was_enabled:
            gc.enable()
    return out


def measure_one(name: str, variant: str, layers: int, grad_mode: str, calls: int, batches: int,
                warmup: int) -> dict[str, Any]:
    reset_all()
    grad = grad_mode == "grad"
    vocab = LlamaConfig().vocab if name == "llama-like" else 256
    ids = torch.randint(0, vocab, INPUT_SHAPE, generator=torch.Generator().manual_seed(0))
    if variant == "eager":  # the real forward: a few calls are enough to see its scale
        calls, batches, warmup = max(5, calls // 50), min(batches, 3), 2
    ctx = contextlib.nullcontext() if grad else torch.no_grad()
    with ctx:
        fn, compiled, model = _build(name, variant, layers, grad)
        t0 = time.perf_counter()
        y = fn(ids)
        first_s = time.perf_counter() - t0
        shape_ok = tuple(_logits(y).shape) == tuple(_logits(model(ids)).shape)
        for _ in range(warmup):
            fn(ids)
        captures_before, graphs_before = _captures(fn), len(compiled)
        per_call = _time_batches(fn, ids, calls, batches)
        captures_after, graphs_after = _captures(fn), len(compiled)
    r: dict[str, Any] = {
        "per_call_s": per_call,
        "median_s": statistics.median(per_call),
        "min_s": min(per_call),
        "calls": calls,
        "batches": batches,
        "warmup": warmup,
        "first_call_s": first_s,
        "output_shape_ok": shape_ok,
        "error": None,
    }
    if variant != "eager":
        r["backend_calls"] = graphs_after
        r["recompiled_while_timed"] = graphs_after != graphs_before or captures_after != captures_before
    if variant.startswith("stampout"):
        r["captures"] = captures_after
        r["traces"] = getattr(fn, "fn", fn).stats.traces
    if variant == "torch_nested":
        r["subgraphs"] = sum(
            1 for g in compiled for n, _ in g.named_children() if n.startswith(("subgraph", "invoke_subgraph"))
        )
    del fn, model
    reset_all()
    return r


def measure_interleaved(variants: list[str], models: list[str], layers: list[int], grad_modes: list[str],
                        calls: int, batches: int, warmup: int, threads: int | None = None) -> dict[str, dict]:
    """Every variant of one (model, layers, grad mode) built in this process, then timed in alternating
    batches, so that load from other processes falls on all of them alike; the reported time is the minimum
    over batches (the least disturbed one)."""
    if threads:
        torch.set_num_threads(threads)
    out: dict[str, dict[str, Any]] = {v: {} for v in variants}
    for name, n, gm, key in _keys(models, layers, grad_modes):
        grad = gm == "grad"
        vocab = LlamaConfig().vocab if name == "llama-like" else 256
        ids = torch.randint(0, vocab, INPUT_SHAPE, generator=torch.Generator().manual_seed(0))
        ctx = contextlib.nullcontext() if grad else torch.no_grad()
        built: dict[str, tuple] = {}
        with ctx:
            for v in variants:
                try:
                    fn, compiled, _ = _build(name, v, n, grad)
                    for _ in range(warmup + 1):
                        fn(ids)
                    built[v] = (fn, compiled, _captures(fn), len(compiled))
                except Exception as e:  # noqa: BLE001 - report, don't stop
                    out[v][key] = {"median_s": None, "error": short_error(e)}
            times: dict[str, list[float]] = {v: [] for v in built}
            for _ in range(batches):
                for v, (fn, *_rest) in built.items():
                    k = max(2, calls // 50) if v == "eager" else calls
                    times[v].extend(_time_batches(fn, ids, k, 1))
        for v, (fn, compiled, captures, graphs) in built.items():
            r: dict[str, Any] = {"per_call_s": times[v], "median_s": min(times[v]), "error": None}
            if v != "eager":
                r["recompiled_while_timed"] = len(compiled) != graphs or _captures(fn) != captures
            out[v][key] = r
        del built
        reset_all()
    return out


def _keys(models: list[str], layers: list[int], grad_modes: list[str]) -> list[tuple[str, int, str, str]]:
    return [(m, n, gm, f"{m}/{n}/{gm}") for m in models for n in layers for gm in grad_modes]


def measure_variant(
    variant: str, models: list[str], layers: list[int], grad_modes: list[str], calls: int, batches: int,
    warmup: int, threads: int | None = None,
) -> dict[str, dict[str, Any]]:
    """``{"<model>/<layers>/<grad_mode>": result}`` for one variant, in this process."""
    if threads:
        torch.set_num_threads(threads)
    out: dict[str, dict[str, Any]] = {}
    for name, n, gm, key in _keys(models, layers, grad_modes):
        try:
            out[key] = measure_one(name, variant, n, gm, calls, batches, warmup)
        except Exception as e:  # noqa: BLE001 - stampout is a work in progress; report, don't stop
            out[key] = {
                "median_s": None,
                "error": short_error(e),
                "traceback": traceback.format_exc(limit=8),
            }
            reset_all()
    return out


def _run_worker(variant: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        variant,
        "--calls",
        str(args.calls),
        "--batches",
        str(args.batches),
        "--warmup",
        str(args.warmup),
        "--layers",
        *map(str, args.layers),
        "--models",
        *args.models,
        "--grad-modes",
        *args.grad_modes,
        "--threads",
        str(args.threads),
        "--clock",
        args.clock,
    ]
    res, err = run_json_worker(cmd, timeout=args.timeout)
    if err is not None:
        return {key: {"median_s": None, **err} for *_, key in _keys(args.models, args.layers, args.grad_modes)}
    return res


# ---------------------------------------------------------------------------------------- report


def _us(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e6:.1f}"


def _get(results: dict, variant: str, key: str) -> float | None:
    r = results.get(variant, {}).get(key)
    return None if not r or r.get("error") else r.get("median_s")


def _cell(results: dict, variant: str, key: str) -> str:
    r = results.get(variant, {}).get(key)
    if r is None:
        return "-"
    if r.get("error"):
        return f"[red]error: {r['error'].split(':')[0][:20]}[/red]"
    if variant == "eager":
        return f"{r['median_s'] * 1e3:.2f} ms"
    cell = _us(r["median_s"])
    if r.get("recompiled_while_timed"):
        cell += " [yellow](recompiled!)[/yellow]"
    return cell


def report(results: dict[str, dict[str, dict[str, Any]]], models: list[str], layers: list[int],
           grad_modes: list[str]) -> None:
    con = console()
    from rich.table import Table

    table = Table(
        title="per-call overhead of a compiled model, noop backend (ids [2, 16]; median µs/call)",
        caption="noop backend: the compiled code returns precomputed zeros, so a call is guards + dispatch. "
        "Ratios: torch / stampout regions (>1: stampout is cheaper). eager fwd: the real forward, for scale.",
    )
    table.add_column("model")
    table.add_column("layers", justify="right")
    table.add_column("grad mode")
    variants = [v for v in VARIANTS if v in results]
    for v in variants:
        table.add_column(LABELS[v], justify="right")
    pairs = [(v, "stampout_regions") for v in ("torch_flat", "torch_nested") if v in results]
    if "stampout_regions" not in results:
        pairs = []
    for a, _ in pairs:
        table.add_column(f"{LABELS[a]} / stampout", justify="right")
    if "eager" in results and "stampout_regions" in results:
        table.add_column("stampout % of eager fwd", justify="right")
    for name, n, gm, key in _keys(models, layers, grad_modes):
        row = [name, str(n), gm] + [_cell(results, v, key) for v in variants]
        for a, b in pairs:
            num, den = _get(results, a, key), _get(results, b, key)
            row.append("-" if num is None or den is None or den == 0 else f"{num / den:.2f}x")
        if "eager" in results and "stampout_regions" in results:
            so, ea = _get(results, "stampout_regions", key), _get(results, "eager", key)
            row.append("-" if so is None or not ea else f"{100 * so / ea:.1f}%")
        table.add_row(*row)
    con.print(table)
    for v, per in results.items():
        for key, r in per.items():
            if r.get("error"):
                con.print(f"[red]{LABELS[v]} {key}:[/red] {r['error']}")
            elif r.get("output_shape_ok") is False:
                con.print(f"[yellow]{LABELS[v]} {key}: output shape differs from the model's[/yellow]")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[8, 80])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--grad-modes", nargs="+", choices=GRAD_MODES, default=list(GRAD_MODES))
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS))
    p.add_argument("--calls", type=int, default=500, help="calls per timed batch")
    p.add_argument("--batches", type=int, default=5, help="timed batches (the median is reported)")
    p.add_argument("--warmup", type=int, default=50, help="untimed calls after the first")
    p.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads (matters only for the eager reference: with 2 threads on a shared "
        "2-core machine OpenMP stalls whenever another process holds a core)",
    )
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                   help="what a batch is timed by: wall (perf_counter) or thread (time.thread_time: CPU time of "
                   "the calling thread, not counting other processes' load on a shared machine)")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per variant's worker")
    p.add_argument("--quick", action="store_true", help="8 layers, no_grad, 100 calls x 3 batches")
    p.add_argument("--in-process", action="store_true", help="measure every variant in this process")
    p.add_argument("--interleaved", action="store_true",
                   help="in this process, all variants built first, then timed in alternating batches (minimum "
                   "over batches reported): fair ratios on a shared machine")
    p.add_argument("--out", default=os.path.join(_HERE, "out", "guard_overhead.json"))
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.grad_modes, args.calls, args.batches, args.warmup = [8], ["no_grad"], 100, 3, 10
    args.layers = sorted(set(args.layers))
    _clock[0] = CLOCKS[args.clock]

    if args.worker:
        import json

        res = measure_variant(
            args.worker, args.models, args.layers, args.grad_modes, args.calls, args.batches, args.warmup,
            args.threads,
        )
        print(json.dumps(res, default=str))
        return 0

    t_start = time.perf_counter()
    if args.interleaved:
        results = measure_interleaved(args.variants, args.models, args.layers, args.grad_modes, args.calls,
                                      args.batches, args.warmup, args.threads)
    elif args.in_process:
        results = {
            v: measure_variant(
                v, args.models, args.layers, args.grad_modes, args.calls, args.batches, args.warmup, args.threads
            )
            for v in args.variants
        }
    else:
        results = {v: _run_worker(v, args) for v in args.variants}
    total = time.perf_counter() - t_start
    report(results, args.models, args.layers, args.grad_modes)
    ratios: dict[str, dict[str, float | None]] = {}
    for *_, key in _keys(args.models, args.layers, args.grad_modes):
        so = _get(results, "stampout_regions", key)
        ratios[key] = {}
        for v in ("torch_flat", "torch_nested", "stampout_flat"):
            if v in results:
                t = _get(results, v, key)
                ratios[key][f"{v}/stampout_regions"] = t / so if t is not None and so else None
    payload = {
        "bench": "guard_overhead",
        "models": args.models,
        "input": list(INPUT_SHAPE),
        "layers": args.layers,
        "grad_modes": args.grad_modes,
        "calls": args.calls,
        "batches": args.batches,
        "warmup": args.warmup,
        "clock": args.clock,
        **environment(),
        "worker_threads": args.threads,
        "total_s": total,
        "ratios": ratios,
        "results": results,
    }
    return finish(args.out, payload)


if __name__ == "__main__":
    sys.exit(main())
