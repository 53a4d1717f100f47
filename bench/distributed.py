"""FSDP2 on 2 gloo ranks (CPU, 127.0.0.1): per-rank first training step and steady step, stampout.compile vs
torch.compile on the same sharded Llama-like (tests/distributed_worker.py: each block and the root
`fully_shard`ed), and how both grow with depth.

    python bench/distributed.py                       # depths 4, 8 and 16, backend aot_eager
    python bench/distributed.py --depths 4 --backend eager
    python bench/distributed.py --src ../main/src     # another checkout's stampout
    python bench/distributed.py --before ../main/src  # and that one too, as a third variant (before/after, same run)
    python bench/distributed.py --repeat 3            # each figure the least of 3 interleaved runs (a busy machine)
    python bench/distributed.py --model hf            # a transformers Llama (random weights from a config), each
                                                      # decoder layer and the root fully_shard'ed

Each cell is 2 fresh processes (one per rank). *first* is from the compile call to the end of the first
`backward()` (capture, compile, one step), wall clock and the rank process's CPU time (*first cpu*: steadier on a
shared machine); *steady* the median wall time of the next 10 steps, *steady cpu* the least thread CPU time of
one of them (min of 10: what a step costs when the machine leaves it alone); each the slower rank's. With
`--repeat N` every cell runs N times, the variants interleaved, and each figure is the least of the N.
Ratios are stampout / torch.compile from the same run: below 1 stampout is faster. Raw numbers:
bench/out/distributed.json. Timings on a shared 2-core machine are noisy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)


def _rank(variant: str, depth: int, backend: str, out: str, model_kind: str) -> None:
    sys.path[:0] = [os.environ.get("STAMPOUT_BENCH_SRC") or os.path.join(_ROOT, "src"), os.path.join(_ROOT, "tests")]
    import torch
    import torch.distributed as dist
    from distributed_worker import sharded_hf_llama, sharded_llama

    import stampout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    model = sharded_hf_llama(depth) if model_kind == "hf" else sharded_llama(depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(fn) -> None:
        out = fn(input_ids=ids, use_cache=False).logits if model_kind == "hf" else fn(ids)
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step(model)  # (FSDP's lazy init and a warm eager step, before the clock)
    start, cpu = time.perf_counter(), time.process_time()
    fn = torch.compile(model, backend=backend) if variant == "torch" else stampout.compile(model, backend=backend)
    step(fn)
    first, first_cpu = time.perf_counter() - start, time.process_time() - cpu
    times, cpus, eager = [], [], []
    for _ in range(10):
        t, c = time.perf_counter(), time.thread_time()
        step(fn)
        times.append(time.perf_counter() - t)
        cpus.append(time.thread_time() - c)
    for _ in range(10):
        t = time.perf_counter()
        step(model)
        eager.append(time.perf_counter() - t)
    with open(out, "w") as f:
        json.dump({"first": first, "first_cpu": first_cpu, "steady": statistics.median(times),
                   "steady_cpu": min(cpus), "eager": statistics.median(eager)}, f)
    dist.destroy_process_group()


def _cell(variant: str, depth: int, backend: str, src: str | None, model_kind: str, timeout: float = 1200) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        procs, outs = [], []
        for rank in range(2):
            out = os.path.join(tmp, f"{rank}.json")
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       STAMPOUT_BENCH_SRC=src or "")
            procs.append(subprocess.Popen([sys.executable, __file__, "--rank", variant, str(depth), backend, out,
                                           model_kind],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            outs.append(out)
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
        if any(p.returncode for p in procs) or not all(os.path.exists(o) for o in outs):
            return {"error": logs[0][-400:] + logs[1][-400:]}
        ranks = [json.load(open(o)) for o in outs]
    return {k: max(r[k] for r in ranks) for k in ranks[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--src", help="the src folder of the stampout to time (default: this checkout's)")
    parser.add_argument("--before", help="another checkout's src folder, timed as a third variant")
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--repeat", type=int, default=1,
                        help="cells per variant and depth, run interleaved; each figure is the least of them")
    parser.add_argument("--model", choices=("llama", "hf"), default="llama",
                        help="llama: tests/distributed_worker.py's Llama-like; hf: a transformers LlamaForCausalLM")
    parser.add_argument("--rank", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        variant, depth, backend, out, model_kind = args.rank
        _rank(variant, int(depth), backend, out, model_kind)
        return 0
    rows = []
    srcs = {"stampout": os.path.abspath(args.src) if args.src else None, "torch": None}
    if args.before:
        srcs["before"] = os.path.abspath(args.before)
    print(f"{'depth':>5} {'variant':>9} {'first':>9} {'first cpu':>9} {'steady':>9} {'steady cpu':>10} {'eager':>9}")
    for depth in args.depths:
        cells: dict[str, dict] = {}
        for _ in range(args.repeat):  # (interleaved, so a busy spell of the machine hits every variant alike)
            for v, src in srcs.items():
                cell = _cell(v, depth, args.backend, src, args.model)
                old = cells.get(v)
                cells[v] = cell if old is None or "error" in old else old if "error" in cell else {
                    k: min(old[k], cell[k]) for k in cell}
        for v, c in cells.items():
            if "error" in c:
                print(f"{depth:>5} {v:>9} failed: {c['error']}")
            else:
                print(f"{depth:>5} {v:>9} {c['first']:>8.2f}s {c['first_cpu']:>8.2f}s {c['steady'] * 1e3:>7.1f}ms "
                      f"{c['steady_cpu'] * 1e3:>8.1f}ms {c['eager'] * 1e3:>7.1f}ms")
        b = cells["torch"]
        for v in (v for v in cells if v != "torch"):
            a = cells[v]
            if "error" not in a and "error" not in b:
                print(f"{depth:>5} {v[:3] + '/torch':>9} {a['first'] / b['first']:>9.2f} "
                      f"{a['first_cpu'] / b['first_cpu']:>9.2f} {a['steady'] / b['steady']:>9.2f} "
                      f"{a['steady_cpu'] / b['steady_cpu']:>10.2f}")
        rows.append({"depth": depth, "backend": args.backend, "model": args.model, **{v: c for v, c in cells.items()}})
    os.makedirs(os.path.join(_HERE, "out"), exist_ok=True)
    with open(os.path.join(_HERE, "out", f"distributed{'_hf' if args.model == 'hf' else ''}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
