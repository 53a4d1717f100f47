"""Distinct regions compiled in parallel (backends/parallel.py): a worker process compiles the second distinct region
into Inductor's caches while this process compiles the first, and this process then loads it from there.

The caller waits here, before its first region, until the worker has taken the other (a test hook: otherwise a
worker still importing torch when the caller gets there is overtaken, and the caller compiles it itself)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from blocks import NormGelu

import stampout
from stampout.backends import inductor, parallel
from stampout.torch_internals import dynamo_counters as counters


class _Gate(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    @stampout.region
    def forward(self, x):
        return x * torch.sigmoid(self.down(torch.relu(self.up(x))))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(NormGelu(), NormGelu(), _Gate(), _Gate())


@pytest.fixture
def worker_takes_the_second_region(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # (a cache that holds none of them)
    compile_region_graph = inductor.compile_region_graph

    def after_the_worker_took_its_region(*args):
        deadline = time.monotonic() + 300
        while any(job.state == "queued" for job in parallel._jobs.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return compile_region_graph(*args)

    monkeypatch.setattr(inductor, "compile_region_graph", after_the_worker_took_its_region)
    parallel.STATS.update(dict.fromkeys(parallel.STATS, 0))
    with stampout.config.patch(parallel_regions=1, parallel_min_nodes=0):
        yield
    parallel.shutdown()


@pytest.mark.inductor
def test_a_worker_compiles_the_second_region_and_this_process_loads_it_with_eager_gradients(
        worker_takes_the_second_region, caplog):
    model = _model()
    x = torch.randn(2, 4, 8, requires_grad=True)  # (every NormGelu call alike: two distinct regions)
    model(x).pow(2).mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    hits = counters["aot_autograd"]["autograd_cache_hit"]
    with caplog.at_level(logging.WARNING, logger="stampout.backends"):
        out = stampout.compile(model, backend="inductor")(x)
        out.pow(2).mean().backward()
    torch.testing.assert_close(out, model(x))
    torch.testing.assert_close([p.grad for p in model.parameters()], expected)
    assert parallel.STATS["workers_started"] == 1 and parallel.STATS["compiled_by_worker"] == 1, parallel.STATS
    assert counters["aot_autograd"]["autograd_cache_hit"] > hits  # (the worker's region: loaded, not compiled)
    assert "not found in the caches" not in caplog.text and "failed" not in caplog.text


@pytest.mark.inductor
def test_a_region_the_worker_fails_on_is_compiled_here(worker_takes_the_second_region, monkeypatch, caplog):
    payload = parallel._payload
    monkeypatch.setattr(parallel, "_payload", lambda *args: payload(*args)[:-40])  # (a graph the worker cannot read)
    model = _model()
    x = torch.randn(2, 4, 8)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="stampout.backends"):
        out = stampout.compile(model, backend="inductor")(x)
        torch.testing.assert_close(out, model(x))
    assert parallel.STATS["worker_failed"] == 1 and parallel.STATS["compiled_by_worker"] == 0, parallel.STATS
    assert "failed to compile region" in caplog.text


@pytest.mark.parametrize("cpus, setting, jobs, workers", [(2, -1, 3, 0), (3, -1, 3, 1), (8, -1, 3, 3), (16, -1, 9, 4),
                                                          (2, 1, 3, 1), (8, 0, 3, 0), (8, 2, 1, 1)])
def test_how_many_workers(monkeypatch, cpus, setting, jobs, workers):
    """-1: one per CPU beyond two (this process lowers on one, its C++ compiles use the other), at most AUTO_MOST;
    otherwise config.parallel_regions is the most (0, the default: none); never more than the regions."""
    monkeypatch.setattr(parallel, "cpus", lambda: cpus)
    with stampout.config.patch(parallel_regions=setting):
        assert parallel.worker_count(jobs) == workers
    assert stampout.config.parallel_regions == 0 or "STAMPOUT_PARALLEL_REGIONS" in __import__("os").environ


@pytest.mark.inductor
def test_regions_this_cache_holds_go_to_no_worker(worker_takes_the_second_region):
    """A second compile of the same model on the same cache directory (a restart's view: the store remembers the
    region compiles) hands no region to a worker and starts none."""
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        stampout.compile(_model(), backend="inductor")(x)
        assert parallel.STATS["submitted"] == 1, parallel.STATS
        model = _model()
        torch.testing.assert_close(stampout.compile(model, backend="inductor")(x), model(x))
    assert parallel.STATS["submitted"] == 1 and parallel.STATS["workers_started"] == 1, parallel.STATS


def test_no_worker_when_the_caches_are_off(monkeypatch):
    """What a worker compiles reaches this process through the FX graph and AOTAutograd caches: without them, none."""
    from stampout.torch_internals import inductor_config

    started = []
    monkeypatch.setattr(parallel, "_Worker", lambda: started.append(1))
    monkeypatch.setattr(parallel, "_payload", lambda *args: b"payload")
    monkeypatch.setattr(parallel, "cpus", lambda: 8)
    region = ((1,), "subgraph_1", torch.fx.symbolic_trace(lambda x: x + 1), [], False)
    with inductor_config.patch(force_disable_caches=True):
        assert parallel.submit([region]) == 0 and not started
    parallel.release([(1,)])


@pytest.mark.parametrize("workers", [0, 1])
def test_a_region_asks_the_workers_only_when_parallel_regions_are_on(monkeypatch, workers):
    """With parallel regions off (the default) a region's compile neither asks for a worker's result nor counts
    cache hits: the compile alone."""
    from types import SimpleNamespace

    asked = []
    monkeypatch.setattr(parallel, "claim", lambda key: asked.append(key) or False)
    monkeypatch.setattr(parallel, "remember", lambda fingerprint: asked.append(fingerprint))
    monkeypatch.setattr(parallel, "cpus", lambda: 8)
    monkeypatch.setattr(inductor, "compile_region_graph", lambda subgraph, name, vals: subgraph)
    subgraph = torch.fx.symbolic_trace(lambda x: x + 1)
    call = SimpleNamespace(subgraph=subgraph, node=SimpleNamespace(args=(None, "subgraph_0")), operands=(),
                           grad_enabled=False)
    with stampout.config.patch(parallel_regions=workers, parallel_min_nodes=0):
        compiled = inductor._compile_region(call, [torch.ones(2)])
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
    assert len(asked) == (2 if workers else 0), asked
