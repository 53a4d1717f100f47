"""Generation with a KV cache and Inductor: the first `generate` (compile included) and the time per token
after it — stampout's recipe vs torch.compile's recipe vs eager, in one run.

    python bench/generate.py                       # Llama(layers=16, hidden=256), prompt 24, 10 new tokens
    python bench/generate.py --layers 4 --cache static dynamic
    python bench/generate.py --layers 4 --backend eager   # both compilers run the graph eagerly: guard + dispatch cost

Recipes (transformers' documented one for torch.compile; stampout's is the same line):

    model.forward = torch.compile(model.forward)                         # torch
    model.forward = stampout.compile(model.forward, regions="auto")      # stampout

`model.generation_config.disable_compile = True` keeps transformers from compiling on its own. Each (variant,
cache) cell is a fresh interpreter with a new, empty TORCHINDUCTOR_CACHE_DIR; the model is built and an eager
reference generated before the clock. First generate: from the recipe line to the end of the first
`generate` call. Per token: the median over `--repeat` later generate calls of (time / new tokens), for stampout
once the background compile of a new cache length is done (``ready_s`` in the raw numbers: how long after the first
generate that was; until then its calls run the captured graph eagerly, backends/background.py). Tokens
must equal eager's (checked). Ratios are stampout / peer from the same run (targets, issue 21: first generate <= 0.2x,
per token <= 1.0x torch.compile's). The table also lists each timed generate's ms / token in order: stampout's first
timed generate after a compile is slower than its later ones (the first call of each entry after a later capture
moved EPOCH checks in full; each program built in the background makes its first call through Inductor's wrappers
in the first timed generate; an entry makes no instance-facts memo on a generate's new cache after one that did not
pay, guards/instance_facts.py, so memos no longer make the later ones faster one after another), so the median
alone would hide a warm-up that torch.compile's flat rows do not have. On a loaded machine the wall clock is mostly
waiting for a core (a 3 ms decode step taking 7-11 ms): compare per token with `--clock thread` there. Raw numbers:
bench/out/generate.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.common import console, environment, finish, fmt_ratio, run_cold_cell  # noqa: E402

VARIANTS = ("stampout", "torch", "eager")
BASE = "stampout@base"  # stampout from --base-src


def _model(layers: int, hidden: int) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.disable_compile = True
    return model


def run_cell(cell: dict[str, Any]) -> dict[str, Any]:
    import torch

    import stampout

    torch.set_num_threads(cell["threads"])
    model = _model(cell["layers"], cell["hidden"])
    prompt = torch.randint(0, 1024, (1, cell["prompt"]), generator=torch.Generator().manual_seed(0))

    def generate() -> torch.Tensor:
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=cell["new_tokens"], do_sample=False, pad_token_id=0,
                                  cache_implementation=cell["cache"])

    expected = generate()
    started = time.perf_counter()
    ours = cell["variant"] in ("stampout", BASE)
    if ours:
        model.forward = stampout.compile(model.forward, regions="auto", backend=cell["backend"])
    elif cell["variant"] == "torch":
        model.forward = torch.compile(model.forward, backend=cell["backend"])
    tokens = generate()
    first = time.perf_counter() - started
    t0 = time.perf_counter()
    if ours:  # per token once a new length's background compile is done (background.py)
        try:
            from stampout.backends.background import wait_all
        except ImportError:  # (a tree before background compiles)
            wait_all = None
        if wait_all is not None:
            wait_all()
    ready = time.perf_counter() - t0
    per_token = []
    clock = time.thread_time if cell.get("clock") == "thread" else time.perf_counter
    for _ in range(cell["repeat"]):
        t0 = clock()
        again = generate()
        per_token.append((clock() - t0) / cell["new_tokens"])
        assert torch.equal(again, expected)
    captures = model.forward.stats.captures if ours else None
    return {"first_generate_s": first, "ready_s": ready, "per_token_s": statistics.median(per_token), "per_token_all": per_token,
            "tokens_equal": bool(torch.equal(tokens, expected)), "captures": captures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--prompt", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=10)
    p.add_argument("--cache", nargs="+", default=["static"], choices=["static", "dynamic"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"],
                   help="for both compilers; eager: what is left per token is guards and dispatch")
    p.add_argument("--clock", choices=["wall", "thread"], default="wall",
                   help="what the per-token time is measured by: wall (perf_counter) or thread (time.thread_time: "
                   "the calling thread's CPU time, with --threads 1 the forward's too; other processes' load on a "
                   "shared machine does not count). The first generate is always wall time (compile workers).")
    p.add_argument("--base-src", help="also stampout imported from this tree's src (variant stampout@base: "
                   "before/after in one run, each cache's cells interleaved)")
    p.add_argument("--out", default=os.path.join(_HERE, "out", "generate.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(run_cell(json.loads(args.worker))))
        return 0
    started = time.perf_counter()
    rows: dict[str, Any] = {}
    for cache in args.cache:
        for variant in [*args.variants, *([BASE] if args.base_src else [])]:
            cell = {"variant": variant, "cache": cache, "layers": args.layers, "hidden": args.hidden,
                    "prompt": args.prompt, "new_tokens": args.new_tokens, "repeat": args.repeat,
                    "threads": args.threads, "backend": args.backend, "clock": args.clock}
            rows[f"{variant}/{cache}"] = run_cold_cell(__file__, cell, src=args.base_src if variant == BASE else None)
            print(variant, cache, json.dumps(rows[f"{variant}/{cache}"])[:300], flush=True)
    from rich.table import Table

    table = Table(title=f"Llama(layers={args.layers}, hidden={args.hidden}), prompt {args.prompt}, "
                        f"{args.new_tokens} new tokens, backend {args.backend}, cold; "
                        f"per token by the {args.clock} clock, median")
    for column in ("variant", "cache", "first generate s", "ms / token", "each generate's ms / token", "tokens = eager",
                   "captures", "stampout first / this", "stampout per token / this"):
        table.add_column(column)
    for key, row in rows.items():
        variant, cache = key.split("/")
        if "first_generate_s" not in row:
            table.add_row(variant, cache, row.get("error", "?"), "", "", "", "", "", "")
            continue
        ours = rows.get(f"stampout/{cache}", {})
        table.add_row(variant, cache, f"{row['first_generate_s']:.1f}", f"{row['per_token_s'] * 1e3:.2f}",
                      " ".join(f"{t * 1e3:.2f}" for t in row.get("per_token_all", ())), str(row["tokens_equal"]), str(row["captures"] or "-"),
                      fmt_ratio(ours.get("first_generate_s"), row["first_generate_s"]),
                      fmt_ratio(ours.get("per_token_s"), row["per_token_s"]))
    console().print(table)
    payload = {"environment": environment(), "args": vars(args), "rows": rows, "total_s": time.perf_counter() - started}
    return finish(args.out, payload)


if __name__ == "__main__":
    sys.exit(main())
