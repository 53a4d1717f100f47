"""Two gloo ranks per test file: one process-group spawn runs every scenario the file's selected tests need.

Starting two Python processes that import torch and form a process group costs seconds of CPU each time; the
distributed tests used to pay it per test. A test declares the scenario it reads with `@on_ranks("name:args")`
and asks the module-scoped fixture `ranks_fixture(worker)` makes for its reports (`ranks("name:args")`, one
per rank, rank order). The fixture runs, once per module, the scenarios of the module's *selected* tests
(`-k` or `-m "not inductor"` leave the others out), in the order the tests are declared, on 2 processes
talking over 127.0.0.1 (a free port per run, so files may run in parallel).

Timeouts, so a hung collective fails instead of hanging CI: the process group's own (a collective waiting
longer raises in its rank, whose report for that scenario is the error), and here a limit per scenario: when
a rank finishes no scenario for `per_scenario` seconds, both are killed and every test still waiting fails
with the ranks' output. A rank's scenario that raises reports its error; the other scenarios still report.

A rank is `python tests/distributed_ranks.py WORKER OUT SCENARIO...` (env: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). WORKER is a module of tests/ with a `SCENARIOS` dict of functions returning JSON-able reports;
each scenario's report is appended to OUT as one JSON line as soon as it is done, with its CPU seconds.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

_TESTS = os.path.dirname(os.path.abspath(__file__))
_SRC = os.path.join(os.path.dirname(_TESTS), "src")
WORLD = 2


def skip_without_gloo() -> Any:
    """A pytest mark skipping a test where torch.distributed or its gloo backend is not built."""
    import pytest
    import torch

    usable = torch.distributed.is_available() and torch.distributed.is_gloo_available()
    return pytest.mark.skipif(not usable, reason="needs torch.distributed with gloo")


def on_ranks(*scenarios: str) -> Callable:
    """Mark a test as reading the reports of `scenarios` (its module's `ranks` fixture runs them)."""

    def mark(fn: Callable) -> Callable:
        fn.__dict__.setdefault("ranks_scenarios", [])
        fn.ranks_scenarios.extend(s for s in scenarios if s not in fn.ranks_scenarios)
        return fn

    return mark


class Reports:
    """The reports of one run of a module's scenarios; `reports(scenario)`: one per rank, or the test fails."""

    def __init__(self, done: dict[str, list[dict]], failure: str | None) -> None:
        self.done, self.failure = done, failure

    def __call__(self, scenario: str) -> list[dict]:
        import pytest

        got = self.done.get(scenario)
        if got is None or len(got) < WORLD:
            pytest.fail(f"{scenario}: no report from every rank (was it declared with @on_ranks?)\n"
                        f"{self.failure or ''}")
        for rank, report in enumerate(got):
            assert "error" not in report, f"{scenario}, rank {rank}: {report['error']}\n{report.get('traceback')}"
        assert [r["rank"] for r in got] == list(range(WORLD))
        return got


def ranks_fixture(worker: str, per_scenario: float = 420) -> Callable:
    """A module-scoped fixture `ranks` running the module's declared scenarios of `worker` (see the module
    docstring) once, on the first test that asks for it."""
    import pytest

    @pytest.fixture(scope="module")
    def ranks(request: Any, tmp_path_factory: Any) -> Reports:
        wanted: list[str] = []
        for item in request.session.items:
            if getattr(item, "module", None) is request.module:
                for s in getattr(getattr(item, "function", None), "ranks_scenarios", ()):
                    if s not in wanted:
                        wanted.append(s)
        return run_scenarios(worker, wanted, str(tmp_path_factory.mktemp("ranks")), per_scenario)

    return ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def run_scenarios(worker: str, scenarios: list[str], tmp: str, per_scenario: float = 420) -> Reports:
    """Run `scenarios` of `worker` on 2 ranks; what each finished scenario reported, per rank."""
    if not scenarios:
        return Reports({}, None)
    port = _free_port()
    procs, outs, logs = [], [], []
    for rank in range(WORLD):
        out, log = os.path.join(tmp, f"rank{rank}.jsonl"), open(os.path.join(tmp, f"rank{rank}.log"), "w+")
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=os.pathsep.join([_SRC, os.environ.get("PYTHONPATH", "")]),
                   STAMPOUT_CHECK_WORLD="1", TORCHINDUCTOR_COMPILE_THREADS="1", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), worker, out, *scenarios],
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
        outs.append(out)
        logs.append(log)
    failure = None
    try:
        counts, last = [0] * WORLD, time.monotonic()
        while any(p.poll() is None for p in procs):
            now = [len(_lines(o)) for o in outs]
            if now != counts:
                counts, last = now, time.monotonic()
            elif time.monotonic() - last > per_scenario:
                failure = (f"a rank finished no scenario in {per_scenario} s (a hung collective?); done per rank: "
                           f"{counts} of {len(scenarios)}")
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    done: dict[str, list[dict]] = {}
    for out in outs:
        for line in _lines(out):
            done.setdefault(line["scenario"], []).append(line["report"])
    if failure is None and any(p.returncode for p in procs):
        failure = f"a rank exited with {[p.returncode for p in procs]}"
    if failure is not None:
        for rank, log in enumerate(logs):
            log.seek(0)
            failure += f"\n--- rank {rank} output (end) ---\n{log.read()[-4000:]}"
    for log in logs:
        log.close()
    return Reports(done, failure)


def rank_main(worker: str, out_path: str, scenarios: list[str]) -> None:
    """One rank: every scenario in order, each report appended to `out_path` when done."""
    import torch
    import torch.distributed as dist

    import stampout

    sys.path.insert(0, _TESTS)
    torch.set_num_threads(1)
    table = importlib.import_module(worker).SCENARIOS
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        for scenario in scenarios:
            name, *args = scenario.split(":")
            stampout.reset()
            cpu = time.process_time()
            try:
                report = table[name](*args)
                report["rank"] = dist.get_rank()
            except Exception as error:
                report = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
            report["cpu_s"] = round(time.process_time() - cpu, 2)
            with open(out_path, "a") as f:
                f.write(json.dumps({"scenario": scenario, "report": report}) + "\n")
            dist.barrier()  # (the next scenario's collectives start together on both ranks)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2], sys.argv[3:])
