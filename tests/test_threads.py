"""Threads: a capture belongs to its thread; compiled functions serve many threads at once.

Each scenario failed on the process-global capture state this design replaced: every call of a compiled
model from 4 threads raised "called while another capture runs"; a capture while another thread ran the
model eagerly handed that thread fake tensors; two captures at once broke each other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import stampout
from stampout.tools.models import LlamaConfig, LlamaLike


def _run_threads(n: int, target: Callable[[int], Any]) -> list[Any]:
    """Run `target(i)` on `n` threads started together; return results, re-raising the first error."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = target(i)
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("dynamic", [False, None])
def test_threads_call_one_compiled_model_with_varying_shapes(dynamic):
    model = LlamaLike(LlamaConfig(layers=4), regions=True).eval()
    fn = stampout.compile(model, backend="eager", dynamic=dynamic)
    lengths = [4, 6, 8, 4]

    def work(i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for step in range(10):
            ids = torch.randint(0, 128, (2, lengths[(i + step) % 4]), generator=torch.Generator().manual_seed(step))
            with torch.no_grad():
                out.append((fn(ids), model(ids)))
        return out

    for pairs in _run_threads(4, work):
        for got, expected in pairs:
            torch.testing.assert_close(got, expected)
    # False: one per sequence length, whichever thread got there first; None: the first length static, then
    # one symbolic capture for the others
    assert fn.stats.captures == (3 if dynamic is False else 2)
    assert fn.stats.traces == fn.stats.captures  # each capture traces the layer once


def test_capture_while_another_thread_runs_the_model_eagerly():
    model = LlamaLike(LlamaConfig(layers=4), regions=True).eval()
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        expected = model(ids)
    stop = threading.Event()
    eager_results: list[torch.Tensor] = []

    def eager(i: int) -> None:
        if i == 0:
            with torch.no_grad():
                while not stop.is_set():
                    eager_results.append(model(ids))
            return
        try:
            for _ in range(5):
                cap = stampout.capture(model, ids)
                assert (cap.stats.traces, cap.stats.reuses) == (1, 3)
                with torch.no_grad():
                    torch.testing.assert_close(cap(ids), expected)
        finally:
            stop.set()

    _run_threads(2, eager)
    assert eager_results
    for got in eager_results:
        assert type(got) is torch.Tensor
        torch.testing.assert_close(got, expected)


def test_two_threads_capture_two_models_at_once():
    models = [LlamaLike(LlamaConfig(layers=3), regions=True, seed=s).eval() for s in (0, 1)]
    ids = torch.randint(0, 128, (2, 8))

    def work(i: int) -> None:
        for _ in range(5):
            cap = stampout.capture(models[i], ids)
            assert (cap.stats.traces, cap.stats.reuses) == (1, 2)
            with torch.no_grad():
                torch.testing.assert_close(cap(ids), models[i](ids))

    _run_threads(2, work)


def test_a_region_called_on_another_thread_during_a_capture_runs_eagerly():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        @stampout.region
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            started.set()
            release.wait(timeout=30)
            return torch.relu(self.lin(x))

    started, release = threading.Event(), threading.Event()
    block = Block()
    x = torch.randn(2, 8)
    other: list[torch.Tensor] = []

    def capture_then_release(i: int) -> None:
        if i == 0:
            stampout.capture(block, x)
        else:
            started.wait(timeout=30)  # the capture is inside the region now, on the other thread
            release.set()
            other.append(block(x))  # a plain call here: real tensors, no capture state

    _run_threads(2, capture_then_release)
    assert type(other[0]) is torch.Tensor
    torch.testing.assert_close(other[0], torch.relu(block.lin(x)))
