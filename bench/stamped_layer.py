"""Cost of one more stamped layer: stampout.capture against Dynamo + nested_compile_region, in one process.

    python bench/stamped_layer.py --models user hf-llama --depths 1 32 --repeat 3 [--inner 5]

For each model, depth and variant, a fresh model is built and every cache reset, then one capture is timed in
CPU seconds of the capturing thread (`time.thread_time`: what other jobs on a shared machine take is not
counted) and in wall seconds. Variants alternate within each round, so load falls on both alike; the minimum
over rounds is reported (stampout's capture, ~100x cheaper, is taken `--inner` times a round: on a loaded
machine the minimum of a few samples of a 30 ms capture still varies by more than its per-layer cost).
Dynamo's time is its first call's `compile_inner` share of the thread's CPU time
(its capture alone, not the eager run of the first call). Per stamped layer = (t(N) - t(1)) / (N - 1); the
ratio is stampout's per-layer cost as a percentage of Dynamo + nested_compile_region's from the same run.
Models as in `stampout bench` (user: bench/user_model.py; hf-llama: transformers' Llama, regions marked).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

VARIANTS = ("stampout_regions", "dynamo_nested")


def time_once(model: str, variant: str, depth: int) -> tuple[float, float]:
    """(CPU s, wall s) of one capture of a fresh `model` with `depth` layers."""
    from torch._dynamo.utils import compilation_time_metrics

    import stampout
    from stampout.tools.benchmark import build

    module, args, kwargs = build(model, depth, variant)
    stampout.reset()
    torch._dynamo.reset()
    gc.collect()
    gc.disable()
    try:
        if variant == "stampout_regions":
            c0, w0 = time.thread_time(), time.perf_counter()
            cap = stampout.capture(module, *args, **kwargs)
            cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
            assert (cap.stats.traces, cap.stats.reuses) == (1, depth - 1), cap.stats
            return cpu, wall
        compilation_time_metrics.clear()
        compiled = torch.compile(module, backend=lambda gm, _: gm.forward, fullgraph=True)
        c0, w0 = time.thread_time(), time.perf_counter()
        compiled(*args, **kwargs)
        cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
        inner = sum(compilation_time_metrics.get("_compile.compile_inner", [])) or wall
        return cpu * inner / wall, inner  # (the capture's share of the first call's CPU time)
    finally:
        gc.enable()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["user", "hf-llama"])
    p.add_argument("--depths", type=int, nargs=2, default=[1, 32])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--inner", type=int, default=5, help="stampout captures per round (the minimum is kept)")
    a = p.parse_args()
    torch.set_num_threads(1)
    lo, hi = a.depths
    for model in a.models:
        for variant in VARIANTS:  # warm-up: imports and one-time setup are not what is measured
            time_once(model, variant, lo)
        best: dict[tuple[str, int], tuple[float, float]] = {}
        for _ in range(a.repeat):
            for depth in (lo, hi):
                for variant in VARIANTS:
                    for _ in range(a.inner if variant == "stampout_regions" else 1):
                        cpu, wall = time_once(model, variant, depth)
                        old = best.get((variant, depth), (float("inf"), float("inf")))
                        best[(variant, depth)] = (min(old[0], cpu), min(old[1], wall))
        per = {v: [(best[(v, hi)][k] - best[(v, lo)][k]) / (hi - lo) for k in (0, 1)] for v in VARIANTS}
        s, d = per["stampout_regions"], per["dynamo_nested"]
        print(f"{model}: per stamped layer, CPU: stampout {s[0] * 1e3:.2f} ms vs Dynamo + nested {d[0] * 1e3:.1f} ms"
              f" = {100 * s[0] / d[0]:.2f} % (wall: {s[1] * 1e3:.2f} vs {d[1] * 1e3:.1f} ms"
              f" = {100 * s[1] / d[1]:.2f} %)")
        for variant in VARIANTS:
            print(f"  {variant:17s} depth {lo}: {best[(variant, lo)][0] * 1e3:8.1f} ms CPU  depth {hi}: "
                  f"{best[(variant, hi)][0] * 1e3:8.1f} ms CPU  ({hi}/{lo}: "
                  f"{best[(variant, hi)][0] / best[(variant, lo)][0]:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
