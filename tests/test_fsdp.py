"""FSDP2 (`fully_shard`) on 2 gloo ranks: compile trains as eager, one region trace for the sharded blocks.

Each test runs tests/distributed_worker.py as two processes on 127.0.0.1 (a free port per run, so tests may
run in parallel) with a timeout, so a hung collective fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import stampout
from stampout.guards import describe_hooks, hooks_key

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_worker.py")
_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

needs_gloo = pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                reason="needs torch.distributed with gloo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, tmp_path, world: int = 2, timeout: float = 420, worker: str = _WORKER) -> list[dict]:
    """Run `scenario` of `worker` on `world` ranks; their reports, rank order. A rank that hangs or fails fails
    the test."""
    port = _free_port()
    procs, outs = [], []
    for rank in range(world):
        out = tmp_path / f"rank{rank}.json"
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=os.pathsep.join([_SRC, os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, worker, scenario, str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs.append(out)
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{scenario}: a rank did not finish in {timeout} s (a hung collective?)")
    reports = []
    for rank, (p, out, log) in enumerate(zip(procs, outs, logs)):
        assert p.returncode == 0 and out.exists(), f"rank {rank} failed ({p.returncode}):\n{log[-4000:]}"
        report = json.loads(out.read_text())
        assert "error" not in report, f"rank {rank}: {report['error']}\n{report.get('traceback', '')}"
        reports.append(report)
    return reports


@pytest.fixture(scope="module")
def fsdp_reports(tmp_path_factory) -> list[dict]:
    return run_ranks("fsdp_compile:eager,aot_eager", tmp_path_factory.mktemp("fsdp"))


@needs_gloo
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fsdp_compile_trains_as_eager(fsdp_reports, backend):
    for report in fsdp_reports:
        rows = report[backend]["rows"]
        assert len(rows) == 3
        for row in rows:  # loss and every sharded parameter's full gradient, step after step, vs eager
            assert row["params"] == 39 and row["missing"] == []
            assert row["loss"] <= 1e-6 and row["grad"] <= 1e-6, rows


@needs_gloo
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fsdp_world_after_training(fsdp_reports, backend):
    for report in fsdp_reports:  # the optimizer stepped on eager's sharded gradients; FSDP's state is as eager's
        world = report[backend]["world"]
        assert world == {"param": world["param"], "sharded": True, "forwards": []}
        assert world["param"] <= 1e-6


@needs_gloo
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fsdp_sharded_blocks_are_one_region_trace(fsdp_reports, backend):
    for report in fsdp_reports:
        stats = report[backend]["stats"]
        assert (stats["traces"], stats["reuses"]) == (1, 3)
        # embed, head, norm and the 4 blocks, each captured once over 3 steps (the root's own code runs eagerly)
        assert (stats["captures"], stats["recaptures"]) == (7, 7)
        assert len(stats["breaks"]) == 1 and "layers.0 is sharded with fully_shard" in stats["breaks"][0]
        if backend == "aot_eager":  # the 4 blocks' graphs are one AOTAutograd compile
            assert stats["region_compiles"] == 1


@needs_gloo
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fsdp_ranks_capture_the_same_program(fsdp_reports, backend):
    first, second = (r[backend]["stats"] for r in fsdp_reports)
    assert [r["rank"] for r in fsdp_reports] == [0, 1]
    assert first["code"] == second["code"] and "invoke_subgraph" in first["code"]
    assert first == second


@needs_gloo
def test_fsdp_capture_trains_as_eager(fsdp_reports):
    """stampout.capture of the sharded model, called for 3 SGD steps: eager's loss and full gradients, bitwise; the
    optimizer's steps on the sharded gradients leave the parameters as eager's."""
    for report in fsdp_reports:
        rows = report["capture"]["rows"]
        assert len(rows) == 3
        for row in rows:
            assert row["params"] == 39 and row["missing"] == []
            assert row["loss"] <= 1e-6 and row["grad"] <= 1e-6, rows
        world = report["capture"]["world"]
        assert world["sharded"] and world["forwards"] == [] and world["param"] <= 1e-6


@needs_gloo
def test_fsdp_capture_is_one_graph_with_boundaries(fsdp_reports):
    """One graph: each sharded module's hooks are two nodes around its forward, the 4 blocks one region trace;
    the unsharded parameters are outputs of the pre-forward node, not placeholders; both ranks captured it."""
    first, second = (r["capture"]["stats"] for r in fsdp_reports)
    assert (first["traces"], first["reuses"], first["subgraphs"]) == (1, 3, 1)
    assert first["placeholders"] == ["ids"] and first["lint"]
    code = first["code"]
    assert code.count("fsdp_pre_forward(") == code.count("fsdp_post_forward(") == 5  # the root and 4 blocks
    assert code.count("invoke_subgraph(") == 4 and "layers_3_attn_q_weight = fsdp_pre_forward" in code
    assert first == second


class _Scale:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def hook(self, module, args):
        return (args[0] * self.factor,)


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    @stampout.region
    def forward(self, x):
        return self.lin(x)


def test_hook_guard_names_what_differs():
    """Hooks bound to different objects are traced apart (a traced hook's state is not guarded), and the miss
    reason shows the two hooks' owners, not two equal counts."""
    torch.manual_seed(0)
    outer = torch.nn.ModuleList([_Layer(), _Layer()])
    a, b = _Scale(2.0), _Scale(3.0)
    outer[0].lin.register_forward_pre_hook(a.hook)
    outer[1].lin.register_forward_pre_hook(b.hook)

    def program(x):
        return outer[1](outer[0](x))

    x = torch.randn(2, 4)
    cap = stampout.capture(program, x)
    torch.testing.assert_close(cap(x), program(x))
    assert cap.stats.traces == 2 and cap.stats.reuses == 0
    reason = cap.events[1].reason
    assert f"<_Scale object at {id(a):#x}>" in reason and f"<_Scale object at {id(b):#x}>" in reason, reason
    assert describe_hooks(hooks_key(outer[0].lin)).startswith("hooks pre [_Scale.hook of <_Scale object")


@needs_gloo
def test_fsdp_hf_llama_per_decoder_layer(tmp_path):
    pytest.importorskip("transformers")
    reports = run_ranks("hf_llama:aot_eager", tmp_path)
    for report in reports:
        for row in report["rows"]:
            assert row["params"] == 21 and row["missing"] == [] and row["loss"] <= 1e-6 and row["grad"] <= 1e-6
        assert report["world"]["sharded"] and report["world"]["param"] <= 1e-6
        stats = report["stats"]
        assert (stats["traces"], stats["reuses"]) == (1, 1)
        assert stats["captures"] == stats["recaptures"] == 6  # embed, rotary, 2 decoder layers, norm, head
    assert reports[0]["stats"] == reports[1]["stats"]


@needs_gloo
@pytest.mark.inductor
def test_fsdp_inductor_tiny_stack(tmp_path):
    """Two sharded blocks through Inductor: one region compiled, eager's gradients. (The first block's input
    does not require grad, the second's does: with torch 2.13's C++ wrapper in training the first block's
    gradients were 13 % off — see backends/inductor.py.)"""
    reports = run_ranks("fsdp_inductor", tmp_path)
    for report in reports:
        for row in report["rows"]:
            assert row["params"] == 18 and row["missing"] == []
            assert row["loss"] <= 1e-5 and row["grad"] <= 1e-5, report["rows"]
        assert report["world"]["sharded"] and report["world"]["param"] <= 1e-5
        assert (report["stats"]["traces"], report["stats"]["reuses"]) == (1, 1)
    assert reports[0]["stats"] == reports[1]["stats"]


@needs_gloo
def test_tensor_parallel_regions_reused(tmp_path):
    """DTensor parameters (parallelize_module: gate/up column-wise, down row-wise) in regions marked by
    regions="auto": tensor parallelism's per-module hooks compare by value, so the 4 blocks are one trace;
    aot_eager compiles them (region calls with DTensor operands inlined), with eager's gradients."""
    reports = run_ranks("tp:eager,aot_eager", tmp_path)
    for report in reports:
        for backend in ("eager", "aot_eager"):
            for row in report[backend]["rows"]:
                assert row["params"] == 16 and row["missing"] == [] and row["loss"] <= 1e-6 and row["grad"] <= 1e-6
            stats = report[backend]["stats"]
            assert (stats["traces"], stats["reuses"], stats["recaptures"]) == (1, 3, 1), stats
    assert reports[0]["eager"]["stats"] == reports[1]["eager"]["stats"]
    assert reports[0]["aot_eager"]["stats"] == reports[1]["aot_eager"]["stats"]


@needs_gloo
def test_tensor_parallel_hooks_with_other_values_trace_again(tmp_path):
    """Tensor parallelism's hooks compare by value: blocks whose style differs in a field are traced apart."""
    reports = run_ranks("tp:eager:auto:mixed", tmp_path)
    for report in reports:
        for row in report["eager"]["rows"]:
            assert row["missing"] == [] and row["loss"] <= 1e-6 and row["grad"] <= 1e-6
        stats = report["eager"]["stats"]
        assert (stats["traces"], stats["reuses"]) == (2, 2), stats
        assert "compared by value" in stats["misses"][0]


def test_inline_regions_computes_what_the_region_graph_does():
    from stampout.backends.inline import inline_regions
    from stampout.torch_internals import INVOKE_SUBGRAPH

    torch.manual_seed(0)
    layers = torch.nn.ModuleList([_Layer(), _Layer(), _Layer()])

    def program(x):
        for layer in layers:
            x = layer(x)
        return x

    x = torch.randn(2, 4)
    cap = stampout.capture(program, x)
    flat = inline_regions(cap.gm)
    flat.graph.lint()
    assert not [n for n in flat.graph.nodes if n.target is INVOKE_SUBGRAPH]
    inputs = cap.placeholders_for((x,), {})
    torch.testing.assert_close(flat(*inputs)[0], program(x))
