"""A new size's symbolic recapture lowers in the background too (backends/background.Lowering): AOTAutograd and
lowering run on the thread its first call starts, with the caller's grad mode, one lowering at a time; what the
lowering assumes beyond the capture's guards keeps the calls outside it eager; the caller's random draws meanwhile
are not rewound by torch's `preserve_rng_state`."""

from __future__ import annotations

import threading

import pytest

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from stampout.backends import background
from stampout.torch_internals import FakeTensorMode


def _symbolic_input(n: int = 8) -> torch.Tensor:
    mode = FakeTensorMode(shape_env=ShapeEnv())
    return mode.from_tensor(torch.ones(n), symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC]))


def _eager_plus_one() -> fx.GraphModule:
    return background.eager_runner(fx.symbolic_trace(lambda x: x + 1))


def test_the_lowering_runs_on_the_thread_its_first_call_starts_with_the_callers_grad_mode():
    seen, release = [], threading.Event()

    def lower(finish):
        seen.append((threading.current_thread() is threading.main_thread(), torch.is_grad_enabled()))
        release.wait(30)
        finish.append(lambda: seen.append("built"))
        return lambda x: x * 3

    with torch.no_grad():
        deferred = background.Lowering(_eager_plus_one(), lower, [_symbolic_input()], "test graph")
    assert seen == []  # (nothing lowers before the first call: the caller reads the ShapeEnv for its guards first)
    assert deferred(torch.ones(8)).tolist() == [2.0] * 8  # (lowering: eager)
    release.set()
    assert deferred.wait(30) and seen == [(False, False), "built"]
    assert deferred(torch.ones(5)).tolist() == [3.0] * 5  # compiled, for every size


def test_what_the_lowering_assumes_beyond_the_capture_keeps_the_calls_outside_it_eager():
    x = _symbolic_input()
    stats = dict(background.LOWERING_STATS)

    def lower(finish):
        assert x.shape[0] <= 10  # (a guard added to the ShapeEnv while lowering, as Inductor's are)
        return lambda t: t * 3

    deferred = background.Lowering(_eager_plus_one(), lower, [x], "test graph")
    assert deferred.wait(30)
    assert deferred(torch.ones(9)).tolist() == [3.0] * 9  # (within what the lowering assumed: compiled)
    assert deferred(torch.ones(12)).tolist() == [2.0] * 12  # (outside: eager)
    assert background.LOWERING_STATS["assumed_more"] - stats["assumed_more"] == 1


def test_a_lowering_that_fails_leaves_the_eager_run():
    def lower(finish):
        raise RuntimeError("no lowering")

    deferred = background.Lowering(_eager_plus_one(), lower, [_symbolic_input()], "test graph")
    assert not deferred.wait(30) and isinstance(deferred.error, RuntimeError)
    assert deferred(torch.ones(4)).tolist() == [2.0] * 4


def test_the_callers_random_draws_during_a_lowering_are_not_rewound():
    """AOTAutograd and Inductor restore the global RNG state when they finish (`preserve_rng_state`); on a lowering
    thread that would rewind what the calling thread drew meanwhile."""
    import torch._dynamo.utils as dynamo_utils
    import torch._functorch.aot_autograd as aot_autograd

    for module in (dynamo_utils, aot_autograd):
        entered, release = threading.Event(), threading.Event()

        def lower(finish, module=module, entered=entered, release=release):
            with module.preserve_rng_state():
                entered.set()
                release.wait(30)
            return lambda t: t * 3

        torch.manual_seed(0)
        expected = torch.rand(6).tolist()
        torch.manual_seed(0)
        deferred = background.Lowering(_eager_plus_one(), lower, [_symbolic_input()], "test graph")
        deferred(torch.ones(2))
        assert entered.wait(30)
        drawn = torch.rand(3).tolist()
        release.set()
        assert deferred.wait(30)
        assert drawn + torch.rand(3).tolist() == expected


def test_one_lowering_at_a_time_and_only_from_a_plain_thread_state():
    inside, release, waited = threading.Event(), threading.Event(), []

    def lower(finish):
        inside.set()
        release.wait(30)
        return lambda t: t * 3

    deferred = background.Lowering(_eager_plus_one(), lower, [_symbolic_input()], "test graph")
    deferred(torch.ones(2))
    assert inside.wait(30)

    def compile_here():
        with background.lowering():
            waited.append(deferred._run is not None)  # (a compile on another thread waits for the lowering)

    other = threading.Thread(target=compile_here)
    other.start()
    other.join(0.2)
    assert waited == []
    release.set()
    other.join(30)
    assert deferred.wait(30)
    assert len(waited) == 1  # (after the lowering)
    assert background.lowers_later()
    with torch.inference_mode():
        assert not background.lowers_later()
    with torch.autocast("cpu"):
        assert not background.lowers_later()


@pytest.mark.inductor
def test_a_new_length_runs_eagerly_while_it_lowers_then_compiled_for_every_length():
    """dynamic=None with Inductor: the second length's symbolic recapture returns before its lowering (the call runs
    the captured graph eagerly), and once built the compiled program serves that length and the next; values are
    eager's throughout, and two captures serve the three lengths."""
    import copy

    import stampout
    from stampout.backends import direct_call
    from stampout.tools.models import make_input, make_model

    model = make_model("llama", regions=True, layers=2, hidden=32, intermediate=64)
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="inductor")
    lowered = background.LOWERING_STATS["lowered"]
    with torch.no_grad():
        for i, t in enumerate((8, 13, 21, 13)):
            (ids,) = make_input("llama", seq=t, model=model, seed=i)
            calls = sum(direct_call.calls.values())
            torch.testing.assert_close(fn(ids), reference(ids), rtol=1e-4, atol=1e-4)
            if i == 1:
                assert sum(direct_call.calls.values()) == calls  # (eager: the lowering has not started before it)
                background.wait_all()
                assert background.LOWERING_STATS["lowered"] == lowered + 1
            if i >= 2:
                assert sum(direct_call.calls.values()) > calls  # (compiled)
    assert fn.stats.captures == 2


@pytest.mark.inductor
def test_a_background_lowering_changes_none_of_torchs_process_wide_flags():
    """While Inductor lowers a symbolic graph on the thread, the calling thread sees torch's process-wide flags (those
    every fingerprint holds: anomaly detection, deterministic algorithms, ...) as they were: otherwise its guards
    miss (a capture more) and its eager code runs under the lowering's settings."""
    import copy

    import stampout
    from stampout.tools.models import make_input, make_model
    from stampout.torch_internals import global_flags

    model = make_model("llama", regions=True, layers=2, hidden=32, intermediate=64)
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="inductor")
    flags, seen = global_flags(), set()
    lowered = background.LOWERING_STATS["lowered"]
    with torch.no_grad():
        for i, t in enumerate((8, 13)):
            (ids,) = make_input("llama", seq=t, model=model, seed=i)
            torch.testing.assert_close(fn(ids), reference(ids), rtol=1e-4, atol=1e-4)
        while background.LOWERING_STATS["lowered"] == lowered and background._started:  # (lowering)
            seen.add(global_flags())
        background.wait_all()
        for i, t in enumerate((21, 34)):
            (ids,) = make_input("llama", seq=t, model=model, seed=i)
            torch.testing.assert_close(fn(ids), reference(ids), rtol=1e-4, atol=1e-4)
    assert seen <= {flags} and len(seen) == 1
    assert fn.stats.captures == 2


@pytest.mark.inductor
def test_a_size_outside_what_the_background_lowering_assumed_captures_again(monkeypatch):
    """Where the lowering assumes more about the sizes than the capture did (here, made to: the sequence at most 20),
    the entry's guards take that in once it is done: a longer sequence captures again instead of being served by a
    program compiled for shorter ones (or running eagerly for good). Values are eager's throughout."""
    import copy

    import stampout
    from stampout.backends import inductor
    from stampout.tools.models import make_input, make_model

    compile_graph = inductor._compile_graph

    def assuming_at_most_20(gm, example_inputs, finish_later=None):
        compiled = compile_graph(gm, example_inputs, finish_later)
        sizes = [t.shape[-1] for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() == 2
                 and isinstance(t.shape[-1], torch.SymInt)]
        if sizes:
            bool(sizes[0] <= 20)  # (a guard in the ShapeEnv, as Inductor's are)
        return compiled

    monkeypatch.setattr(inductor, "_compile_graph", assuming_at_most_20)
    model = make_model("llama", regions=True, layers=2, hidden=32, intermediate=64)
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="inductor")
    assumed = background.LOWERING_STATS["assumed_more"]
    with torch.no_grad():
        for i, t in enumerate((8, 13, 16, 21)):
            (ids,) = make_input("llama", seq=t, model=model, seed=i)
            torch.testing.assert_close(fn(ids), reference(ids), rtol=1e-4, atol=1e-4)
            background.wait_all()
            assert fn.stats.captures == {8: 1, 13: 2, 16: 2, 21: 3}[t]
    assert background.LOWERING_STATS["assumed_more"] >= assumed + 1


def test_a_background_lowering_compiles_under_the_callers_inductor_settings(monkeypatch):
    """mode=/options= (and stampout's own `fallback_random`: eager's random numbers) are Inductor config patches the
    caller holds around the compile (backends/options.with_patches); the lowering thread runs after they are undone,
    so it takes them along."""
    from stampout.backends import inductor, options
    from stampout.torch_internals import inductor_config

    seen = []

    def compile_graph(gm, example_inputs, finish_later=None):
        seen.append((inductor_config.fallback_random, inductor_config.epilogue_fusion))
        return lambda t: t * 3

    monkeypatch.setattr(inductor, "_compile_graph", compile_graph)
    compile_with = options.with_patches(inductor.compile_graph,
                                        options.inductor_patches("inductor", None, {"epilogue_fusion": False}))
    with background.recompiling(True):
        deferred = compile_with(fx.symbolic_trace(lambda x: x + 1), [_symbolic_input()])
    assert isinstance(deferred, background.Lowering)
    assert deferred(torch.ones(4)).tolist() == [2.0] * 4  # (lowering: eager)
    assert deferred.wait(30) and seen == [(True, False)]
    assert (inductor_config.fallback_random, inductor_config.epilogue_fusion) == (False, True)  # (the caller's, again)


def test_a_default_dtype_changed_by_the_caller_while_it_lowers_leaves_the_calls_eager():
    """The default dtype is process-wide and AOTAutograd traces the graph again on the lowering thread (a
    `torch.ones(n)` of the graph takes it): changed by the caller meanwhile, no compiled program serves."""
    entered, release = threading.Event(), threading.Event()

    def lower(finish):
        entered.set()
        release.wait(30)
        return lambda t: t * 3

    deferred = background.Lowering(_eager_plus_one(), lower, [_symbolic_input()], "test graph")
    deferred(torch.ones(2))
    assert entered.wait(30)
    torch.set_default_dtype(torch.float64)
    try:
        release.set()
        assert not deferred.wait(30)
    finally:
        torch.set_default_dtype(torch.float32)
    assert deferred(torch.ones(4)).tolist() == [2.0] * 4  # (eager)


def test_a_background_lowering_holds_torch_compiles_lock():
    """Inductor's config is process-wide and a lowering patches it: a torch.compile of another function on the
    calling thread meanwhile (Dynamo compiles under its `compile_lock`) waits for the lowering."""
    from stampout.torch_internals import dynamo_compile_lock

    entered, release = threading.Event(), threading.Event()

    def lower(finish):
        entered.set()
        release.wait(30)
        return lambda t: t * 3

    deferred = background.Lowering(_eager_plus_one(), lower, [_symbolic_input()], "test graph")
    deferred(torch.ones(2))
    assert entered.wait(30)
    try:
        assert not dynamo_compile_lock.acquire(timeout=0.2)
    finally:
        release.set()
    assert deferred.wait(30)
    assert dynamo_compile_lock.acquire(timeout=5)
    dynamo_compile_lock.release()


def test_settings_that_benchmark_kernels_lower_on_the_calling_thread():
    """Autotuning (mode='max-autotune', options={'max_autotune': True}) benchmarks kernels on example inputs drawn
    from torch's global generator (select_algorithm's rand_strided): on a lowering thread those draws would rewind
    or advance what the calling thread draws meanwhile."""
    from stampout.torch_internals import inductor_config

    assert background.lowers_later()
    for name in ("max_autotune", "coordinate_descent_tuning"):
        with inductor_config.patch({name: True}):
            assert not background.lowers_later()


def test_the_lowering_thread_starts_after_the_first_eager_call():
    """The first call of a new size runs eagerly before the lowering thread starts: torch's ops release the
    interpreter lock and took it back from the lowering's Python only at a switch interval, so the call that
    made the size symbolic ran ~3x slower beside it. The thread starts when that call returns; later calls serve
    the compiled program once it is done."""
    from stampout.backends import background

    started_during_call = []
    lowering: list = []

    def eager(x):
        started_during_call.append(lowering[0]._thread.ident is not None)
        return x + 1

    def lower(finish):
        return lambda x: x + 1

    lowering.append(background.Lowering(eager, lower, [torch.ones(2)], "symbolic graph"))
    run = lowering[0]
    torch.testing.assert_close(run(torch.ones(2)), torch.full((2,), 2.0))
    assert started_during_call == [False] and run._thread.ident is not None
    assert run.wait(60)
    torch.testing.assert_close(run(torch.ones(2)), torch.full((2,), 2.0))
    assert started_during_call == [False]  # (the compiled program served the second call)
