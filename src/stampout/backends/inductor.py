"""inductor: `compile_fx`, each distinct region subgraph compiled once — and found again on startup.

Two ways to a compiled callable (see split.py for when each is taken):
- *regions apart* (the usual case for stacks of blocks): each distinct region subgraph is compiled as a
  graph of its own and the outer graph runs eagerly, calling the compiled regions;
- *whole*: the captured graph goes to `compile_fx` as it is, regions as invoke_subgraph nodes.

Either way the compile is cacheable, so a restart on the same `TORCHINDUCTOR_CACHE_DIR` loads instead of
compiling: under a TracingContext whose fake mode has a ShapeEnv (without one the FX graph cache bypasses:
"No shape env"), with static shapes from the example inputs (`ignore_shape_env`, as `standalone_compile`
does), and on a copy of the graph whose nodes carry `example_value` (AOTAutogradCache bypasses a graph
with tensor method calls otherwise). Cold, nothing waits that need not: Inductor's once-per-process C++
ISA checks are cut to the one that decides and start in the background (toolchain.py), and a restart neither
hashes torch's sources nor precompiles headers for modules already built (startup.py); in training the
backward is lowered with the forward, and C++ compiles run while the next graph lowers (pipeline.py); the
Python wrapper's kernels of a compile are one library, one compiler run (kernel_batch.py); a graph without
region calls inside is one C++ file (Inductor's C++ wrapper) in inference; distinct regions beyond the first may be
compiled by worker processes meanwhile and loaded from the caches (parallel.py, opt-in); an inference region is
called past AOTAutograd's and Inductor's pass-through wrappers (direct_call.py). Every phase is timed
(`STAMPOUT_LOGS=+timing`, see timing.py).

Two torch 2.13 Inductor bugs give wrong gradients; stampout compiles around both:
- with buffer reuse, reused subgraphs (TORCH_NOTES.md: 31-39 % relative error on the layer norm weights of
  a reused block). Whenever a graph handed to Inductor has region calls *inside* it and will be
  differentiated — the whole graph, or a region with nested regions — it is compiled with
  `allow_buffer_reuse=False`. A region compiled apart is a flat graph and keeps buffer reuse.
- on CPU, horizontal fusion of vectorized kernels: the backward of diffusers' SD3 JointTransformerBlock,
  compiled on its own (as regions apart are, and as diffusers' compile_repeated_blocks does), is off by
  0.4-1 % (in float64 too: not rounding). With `cpp.max_horizontal_fusion_size=1` it is exact, and no
  slower here; every CPU graph is compiled so.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .. import config, torch_internals
from ..errors import StampoutError
from ..torch_internals import INVOKE_SUBGRAPH, TracingContext, is_traceable_wrapper_subclass, tracing
from . import background, direct_call, parallel, pipeline, progress, split, startup, timing, toolchain
from .grad_identity import separate_by_requires_grad
from .undifferentiated import detach_undifferentiated_operands
from .inline import inline_regions, inline_writing_regions, subclass_operands

log = logging.getLogger("stampout.backends")

# Switches (config.py): avoid_reused_subgraph_buffer_bug and avoid_horizontal_fusion_bug (False only to reproduce
# the torch bugs: see the module docstring and the regression tests); glue; cpp_wrapper: graphs without region
# calls inside (a region compiled apart, a flat graph) on CPU compile with Inductor's C++ wrapper: wrapper and
# kernels in one C++ file, one compiler run per graph instead of three per kernel (about half the compiler time);
# Inductor has no C++-wrapper code for invoke_subgraph. A graph the C++ wrapper cannot compile is compiled again
# without it. Inference only: see the Note below.


# Note: no C++ wrapper in training
# torch 2.13's C++ wrapper gave wrong gradients when one region is compiled apart twice for training (a
# stack whose first block gets an input that does not require grad and the others one that does: two
# variants): the first block's parameter gradients were 13 % off, with the Python wrapper exact (measured on
# tests/distributed_worker.py's Stack, FSDP or not). Training graphs are compiled with the Python wrapper.


def has_region_calls(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target is INVOKE_SUBGRAPH for n in gm.graph.nodes)


def needs_workaround(gm: fx.GraphModule, example_inputs: list[Any]) -> bool:
    return split.trains(example_inputs) and has_region_calls(gm)


def _config_patches(gm: fx.GraphModule, example_inputs: list[Any]) -> dict[str, Any]:
    patches: dict[str, Any] = {}
    on_cpu = _on_cpu(example_inputs)
    if on_cpu and config.avoid_horizontal_fusion_bug:
        patches["cpp.max_horizontal_fusion_size"] = 1
    if not has_region_calls(gm):
        if (config.cpp_wrapper and on_cpu and not split.trains(example_inputs)
                and not any(is_traceable_wrapper_subclass(t) for t in example_inputs)):  # (a DeviceMesh in C++)
            patches["cpp_wrapper"] = True
    elif config.avoid_reused_subgraph_buffer_bug and needs_workaround(gm, example_inputs):
        log.info("inductor: training a graph with region calls inside; compiling it with allow_buffer_reuse=False "
                 "(torch 2.13 returns wrong gradients for reused subgraphs otherwise)")
        patches["allow_buffer_reuse"] = False
    return patches


def _on_cpu(example_inputs: list[Any]) -> bool:
    return all(t.device.type == "cpu" for t in example_inputs if isinstance(t, torch.Tensor))


def _copy(gm: fx.GraphModule, example_values: bool = False, input_values: bool = True) -> fx.GraphModule:
    """A copy of `gm` (nested subgraphs too) that compile_fx may change; node metadata is copied shallowly.
    With `example_values`, nodes carry `example_value` (AOTAutogradCache requires it on tensor method calls);
    without `input_values`, placeholders carry no `val` (see Note: symbolic graphs and the C++ wrapper)."""
    graph = copy.deepcopy(gm.graph)  # fx.Graph's deepcopy: new nodes, each with a shallow copy of its meta
    attrs: dict[str, Any] = {}
    for node in graph.nodes:
        if example_values and "val" in node.meta and "example_value" not in node.meta:
            node.meta["example_value"] = node.meta["val"]
        if not input_values and node.op == "placeholder":
            node.meta.pop("val", None)
            node.meta.pop("example_value", None)
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            attrs[node.target] = _copy(value, example_values) if isinstance(value, fx.GraphModule) else value
    return fx.GraphModule(attrs, graph, class_name=type(gm).__name__)


# Note: symbolic graphs and the C++ wrapper
# With the C++ wrapper, torch 2.13's compile_fx takes a graph's inputs from its placeholders' `val` where they have
# one (`_extract_inputs_from_exported_gm`, written for exported programs) and puts None for every input that is not
# a tensor: a symbolic graph's size inputs arrive as None ("view() received ... NoneType") and the compile fails
# before lowering. A symbolic graph is therefore handed over with no `val` on its placeholders: compile_fx then
# uses the example inputs, the capture's fakes with their symbols. A symbolic region compiled so is one C++ file
# for every length, like a static one (instead of a Python wrapper with a C++ module per kernel).


def _timed_inner_compile(what: str) -> Callable[..., Any]:
    """compile_fx's per-graph compiler, timed: lowering, C++ compile and module load, or a cache hit."""
    from ..torch_internals import compilation_time_metrics, compile_fx_inner
    from ..torch_internals import dynamo_counters as counters

    def sum_of(key: str) -> float:
        return sum(compilation_time_metrics.get(key, ()))

    def inner(gm: fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        from ..torch_internals import inductor_config as config

        kind = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
        lazy = timing.current() is None  # a backward compiled during the first loss.backward()
        cpp_wrapper = config.cpp_wrapper
        with timing.record(f"backward compile: {what}") if lazy else contextlib.nullcontext(), \
                startup.scope(backward_follows=kind == "forward"):
            rec = timing.current()
            wait, load = sum_of("async_compile.wait"), sum_of("PyCodeCache.load_by_key_path")
            hits = counters["inductor"]["fxgraph_cache_hit"]
            with timing.phase("inductor lowering"):
                compiled = _compile_inner(compile_fx_inner, gm, example_inputs, f"{what} {kind} graph", **kwargs)
            wait, load = sum_of("async_compile.wait") - wait, sum_of("PyCodeCache.load_by_key_path") - load
            rec.move("inductor lowering", "c++ compile", wait)
            # Without pipeline.overlapped, the C++ wrapper's one compiler run happens while the module loads.
            rec.move("inductor lowering", "c++ compile" if cpp_wrapper else "module load", load - wait)
            if counters["inductor"]["fxgraph_cache_hit"] > hits:
                rec.move("inductor lowering", "cache load", float("inf"))
        return compiled

    return inner


def _compile_inner(compile_fx_inner: Callable[..., Any], gm: fx.GraphModule, example_inputs: Any, what: str,
                   **kwargs: Any) -> Any:
    """compile_fx_inner; a graph the C++ wrapper cannot compile is compiled with the Python wrapper."""
    from ..torch_internals import inductor_config as config

    if not config.cpp_wrapper:
        return compile_fx_inner(gm, example_inputs, **kwargs)
    try:
        return compile_fx_inner(_copy(gm), example_inputs, **kwargs)
    except Exception as error:  # noqa: BLE001 - any failure of the C++ wrapper: the Python wrapper is the fallback
        log.warning("inductor: the C++ wrapper failed on the %s (%s: %s); compiling it with the Python wrapper",
                    what, type(error).__name__, (str(error).splitlines() or [""])[0][:200])
    with config.patch(cpp_wrapper=False):
        return compile_fx_inner(gm, example_inputs, **kwargs)


def _compile(gm: fx.GraphModule, example_inputs: list[Any], what: str, patches: dict[str, Any]) -> Any:
    """compile_fx under the cache-friendly context (see the module docstring), timed."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from ..torch_internals import FakeTensorMode, compile_fx
    from ..torch_internals import dynamo_counters as counters

    fake_mode = _fake_mode(example_inputs) or FakeTensorMode(shape_env=ShapeEnv())
    rec = timing.current()
    hits = counters["aot_autograd"]["autograd_cache_hit"]
    before = rec.seconds.get("aot autograd", 0.0) if rec else 0.0
    with timing.phase("aot autograd"):
        # In training the backward is lowered now, not at the first backward(), so it overlaps the
        # forward's C++ compile (pipeline.overlapped) and fails, if it fails, inside the backend.
        with tracing(TracingContext(fake_mode)), \
                torch_internals.functorch_config.patch(force_non_lazy_backward_lowering=split.trains(example_inputs)):
            compiled = _compile_fx(compile_fx, gm, example_inputs, what, patches)
    hit = counters["aot_autograd"]["autograd_cache_hit"] > hits
    if rec and hit:
        rec.move("aot autograd", "cache load", rec.seconds.get("aot autograd", 0.0) - before)
    progress.compiled(from_cache=hit)
    return compiled


def _compile_fx(compile_fx: Callable[..., Any], gm: fx.GraphModule, example_inputs: list[Any], what: str,
                patches: dict[str, Any]) -> Any:
    """compile_fx on a copy of `gm`; a graph the C++ wrapper cannot take (before its inner compile, which has its
    own fallback: `_compile_inner`) is compiled with the Python wrapper."""
    symbolic = split.symbolic(example_inputs)

    def run(options: dict[str, Any], input_values: bool = True) -> Any:
        return compile_fx(_copy(gm, example_values=True, input_values=input_values), example_inputs,
                          inner_compile=_timed_inner_compile(what), config_patches=options or None,
                          ignore_shape_env=not symbolic)

    if not patches.get("cpp_wrapper"):
        return run(patches)
    try:
        return run(patches, input_values=not symbolic)  # (see Note: symbolic graphs and the C++ wrapper)
    except StampoutError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure of the C++ wrapper: the Python wrapper is the fallback
        log.warning("inductor: the C++ wrapper failed on the %s (%s: %s); compiling it with the Python wrapper",
                    what, type(error).__name__, (str(error).splitlines() or [""])[0][:200])
    return run({k: v for k, v in patches.items() if k != "cpp_wrapper"})


def _fake_mode(example_inputs: list[Any]) -> Any:
    from ..torch_internals import detect_fake_mode

    return detect_fake_mode(example_inputs)


def _compile_region(call: split.RegionCall, vals: list[Any]) -> Callable[..., Any]:
    if not parallel.worker_count(1):  # (parallel regions off, the default: no worker to ask, nothing to remember)
        return direct_call.direct(compile_region_graph(call.subgraph, call.node.args[1], vals))
    with timing.phase("region workers"):
        claimed = parallel.claim(_job_key(call))
    hits = counters_hits()
    compiled = compile_region_graph(call.subgraph, call.node.args[1], vals)
    if claimed and counters_hits() == hits:  # (a worker compiled it into the caches: this should have loaded it)
        log.warning("inductor: region %s, compiled by a worker process, was not found in the caches",
                    call.node.args[1])
    if (not split.symbolic(vals)
            and split.compute_nodes(call.subgraph) >= config.parallel_min_nodes):  # (one a worker could get)
        parallel.remember(parallel.fingerprint(call.subgraph, vals, torch.is_grad_enabled()))
    return direct_call.direct(compiled)  # (past the wrappers that do nothing for it: direct_call.py)


def counters_hits() -> int:
    from ..torch_internals import dynamo_counters as counters

    return counters["aot_autograd"]["autograd_cache_hit"]


def compile_region_graph(subgraph: fx.GraphModule, name: str, vals: list[Any]) -> Callable[..., Any]:
    """A region's subgraph compiled apart, for operands like `vals` (here, or in a worker process: parallel.py)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from ..torch_internals import FakeTensorMode

    if split.symbolic(vals):  # compiled for every size: the capture's own fakes, symbols and all
        examples = list(vals)
    else:
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        examples = [split.example_like(v, fake_mode) if isinstance(v, torch.Tensor) else v for v in vals]
    started = time.perf_counter()
    compiled = _compile(subgraph, examples, f"region {name}", _config_patches(subgraph, examples))
    log.debug("inductor: region %s compiled apart in %.2fs", name, time.perf_counter() - started)
    return compiled


def _job_key(call: split.RegionCall) -> tuple:
    return id(call.subgraph), tuple(split.metadata(o.meta["val"]) for o in call.operands), call.grad_enabled


def _compile_ahead(calls: list[split.RegionCall]) -> list[tuple]:
    """The distinct regions after the first that are worth a worker process (parallel.py), handed to workers."""
    if len(calls) < 2 or not parallel.worker_count(len(calls) - 1):
        return []
    regions = []
    for call in calls[1:]:
        vals = [o.meta["val"] for o in call.operands]
        if (split.symbolic(vals) or any(is_traceable_wrapper_subclass(v) for v in vals)
                or split.compute_nodes(call.subgraph) < config.parallel_min_nodes):
            continue
        regions.append((_job_key(call), call.node.args[1], call.subgraph, vals, call.grad_enabled))
    return [region[0] for region in regions] if parallel.submit(regions) else []


def _first_run_timed(fn: Callable[..., Any], what: str) -> Callable[..., Any]:
    first = True

    def run(*args: Any) -> Any:
        nonlocal first
        if not first:
            return fn(*args)
        first = False
        with timing.record(f"first run: {what}"), timing.phase("first run"), startup.scope():
            return fn(*args)

    return run


def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    from ..torch_internals import runtime_metrics_context

    mode = background.deferrable(example_inputs)  # (a recapture: its C++ build in the background, background.py)
    if mode is not None:
        eager = background.eager_runner(gm)  # (before the compile changes gm)
        symbolic = split.symbolic(example_inputs)
        if mode == background.EAGER and symbolic and background.lowers_later():  # (its lowering too: Lowering)
            return background.Lowering(eager, functools.partial(_compile_graph, gm, example_inputs),
                                       example_inputs, "symbolic graph")
        finish_later: list[Callable[[], Any]] = []
        with background.lowering():
            compiled = _compile_graph(gm, example_inputs, finish_later)
        what = "symbolic graph" if symbolic else "recaptured graph"
        compiled = background.Deferred(eager, compiled, finish_later, what, mode)
    else:
        with background.lowering():
            compiled = _compile_graph(gm, example_inputs)
    # Inductor's timed phases outside a Dynamo compile are this thread's *runtime* metrics, recorded (config copies,
    # a metrics record: ~5 ms here) by the next CompiledFxGraph call through its wrappers: after a recapture, the
    # first compiled call of the new program, in a later decode step (the first timed generate). Recorded now, with
    # the compile they measure.
    runtime_metrics_context().finish()
    return compiled


def _compile_graph(gm: fx.GraphModule, example_inputs: list[Any],
                   finish_later: list[Callable[[], Any]] | None = None) -> Callable[..., Any]:
    inline_writing_regions(gm, example_inputs)
    detach_undifferentiated_operands(gm)  # (undifferentiated.py: eager's None gradients)
    separate_by_requires_grad(gm)
    startup.fill_torch_key()
    if _on_cpu(example_inputs):
        toolchain.warm_up()
    subclass = subclass_operands(gm)
    if subclass is not None:  # (see inline.py: invoke_subgraph refuses DTensor operands)
        log.info("inductor: region calls inlined, the graph compiled whole: %s", subclass)
        gm = inline_regions(gm)
        reason = subclass
    elif config.glue == "whole":
        reason = "config.glue is 'whole'"
    else:
        reason = split.reason_to_compile_whole(gm, max_glue=float("inf") if config.glue == "apart" else None)
    what = "whole graph" if reason else f"{len(split.region_calls(gm))} region calls, eager glue"
    if reason:
        progress.expect(1)  # (compiled apart, split.build counts the regions it will compile)
    with timing.record(f"inductor compile: {what}"), startup.scope(), pipeline.overlapped(finish_later):
        if reason:
            if has_region_calls(gm):
                log.info("inductor: compiling the whole graph: %s", reason)
            compiled = _compile(gm, example_inputs, "whole graph", _config_patches(gm, example_inputs))
        else:
            submitted: list[tuple] = []
            try:
                compiled = split.build(gm, _compile_region, key_extra=(config.avoid_reused_subgraph_buffer_bug,
                                                                       config.avoid_horizontal_fusion_bug,
                                                                       config.cpp_wrapper),
                                       ahead=lambda calls: submitted.extend(_compile_ahead(calls)))
            finally:
                parallel.release(submitted)
            with timing.phase("glue"):
                compiled.recompile()
    return _first_run_timed(compiled, what)
