"""A region compiled apart is called past AOTAutograd's and Inductor's wrappers where they do nothing for it
(backends/direct_call.py): in inference from its second call on; never in training. Whatever way is taken, results,
gradients, input mutations (values and version counters) and aliasing are eager's."""

from __future__ import annotations

import pytest
import torch
from blocks import NormGelu

import stampout
from stampout.backends import direct_call

pytestmark = pytest.mark.inductor


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(NormGelu(), NormGelu())


def _calls() -> dict[str, int]:
    return dict(direct_call.calls)


def _delta(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in direct_call.calls.items()}


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_inference_calls_the_compiled_regions_directly_with_eagers_results(cold: bool, monkeypatch, tmp_path) -> None:
    if cold:  # (compiled, not loaded from AOTAutograd's cache: its graph comes wrapped once more)
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = _model()
    compiled = stampout.compile(model, backend="inductor")
    before = _calls()
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 8)
            torch.testing.assert_close(compiled(x), model(x))
    delta = _delta(before)
    assert delta["direct"] >= 4 and delta["wrapped"] <= 2, delta  # (each region's first call goes through)


def test_training_goes_through_the_wrappers_with_eagers_gradients() -> None:
    model, twin = _model(), _model()
    compiled = stampout.compile(model, backend="inductor")
    before = _calls()
    for _ in range(2):
        x = torch.randn(2, 8, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        compiled(x).sum().backward()
        twin(x2).sum().backward()
        torch.testing.assert_close(x.grad, x2.grad)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert _delta(before)["direct"] == 0


class _Writer(torch.nn.Module):
    @stampout.region
    def forward(self, x, cache, pos):
        cache[pos] = x * 2  # (a static KV cache's write)
        return cache.sum(0) + x


class _Writers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Writer(), _Writer()])

    def forward(self, x, caches, pos):
        for block, cache in zip(self.blocks, caches):
            x = block(x, cache, pos)
        return x


def test_a_region_writing_an_input_writes_it_and_bumps_its_version_as_eager() -> None:
    model = _Writers()
    compiled = stampout.compile(model, backend="inductor")
    eager_caches, caches = [torch.zeros(4, 8) for _ in range(2)], [torch.zeros(4, 8) for _ in range(2)]
    before = _calls()
    with torch.no_grad():
        for pos in range(3):
            x = torch.randn(8)
            versions = [c._version for c in eager_caches], [c._version for c in caches]
            expected, out = model(x, eager_caches, pos), compiled(x, caches, pos)
            torch.testing.assert_close(out, expected)
            for ours, theirs in zip(caches, eager_caches):
                torch.testing.assert_close(ours, theirs)
            eager_bumped = [c._version > v for c, v in zip(eager_caches, versions[0])]
            assert [c._version > v for c, v in zip(caches, versions[1])] == eager_bumped
    assert _delta(before)["direct"] > 0  # (AOT's own epilogue, called directly, bumps the versions)


class _Viewer(torch.nn.Module):
    @stampout.region
    def forward(self, x):
        return x.transpose(0, 1), x.sin()


class _Viewers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Viewer(), _Viewer()])

    def forward(self, x):
        outs = []
        for block in self.blocks:
            view, x = block(x)
            outs.append(view)
        return outs, x


def test_a_view_a_region_returns_aliases_its_input_as_in_eager() -> None:
    model = _Viewers()
    compiled = stampout.compile(model, backend="inductor")
    before = _calls()
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 4)
            (views, out), (eager_views, expected) = compiled(x), model(x)
            torch.testing.assert_close(out, expected)
            torch.testing.assert_close(views, eager_views)
            assert views[0].data_ptr() == x.data_ptr() and views[0]._is_view()
            x.add_(1)  # (a view sees its base's writes)
            torch.testing.assert_close(views[0], x.transpose(0, 1))
    assert _delta(before)["direct"] > 0


def test_sizes_that_vary_give_eagers_results() -> None:
    model = _model()
    compiled = stampout.compile(model, backend="inductor", dynamic=True)
    with torch.no_grad():
        for n in (2, 3, 5, 3, 2):
            x = torch.randn(n, 8)
            torch.testing.assert_close(compiled(x), model(x))


def test_the_compile_records_its_own_metrics_not_the_first_compiled_call(monkeypatch, tmp_path) -> None:
    """Inductor's timed phases outside a Dynamo compile count as this thread's runtime metrics, which torch records
    (config copies, a metrics record) at the next CompiledFxGraph call through its wrappers: after a recapture, the
    new program's first call, in a later step of a generate. The compile records them itself: none are left when it
    returns, and calling the compiled program records none. (A cache hit may time no phase: one is added as torch
    adds them.)"""
    import torch.fx as fx

    from stampout.backends import inductor
    from stampout.torch_internals import runtime_metrics_context

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    recorded = []
    metrics = runtime_metrics_context()
    monkeypatch.setattr(metrics, "_on_exit", lambda *args: recorded.append(args[2]))
    metrics.increment("inductor_cumulative_compile_time_us", 1)
    gm = fx.symbolic_trace(lambda x: (torch.nn.functional.gelu(x * 2 + 1),))
    x = torch.randn(2, 8)
    with torch.no_grad():
        compiled = inductor.compile_graph(gm, [x])
        assert len(recorded) == 1
        torch.testing.assert_close(compiled(x)[0], gm(x)[0])
    assert len(recorded) == 1
