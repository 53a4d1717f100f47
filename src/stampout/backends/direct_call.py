"""direct_call: a region compiled apart, called past the layers of wrappers that do nothing for it.

compile_fx's callable for an inference graph is four calls deep: Dynamo's disable wrapper, AOTAutograd's
`aot_module_simplified.forward` (prepends lifted parameters), its runtime wrapper (the codegen'd body: grad off,
input mutations, version counters, output aliases) and `CompiledFxGraph.__call__` (debug and profiler records,
the autotune cache bundler), before the Inductor module's `call`. That is 5-7 us per call on a tiny region here
(wrapped 13.0 us, direct 8.3 us, the bare module 7.5 us), paid once per region call: eight times per decode step
for an 8-layer decoder, where torch.compile pays it once per step (same-process A/B: 0.96x per token).

After a region's first call (through the wrappers, which settle the autotune bundler and AOT's first-call
checks), its callable is taken apart; the direct call is used only when the structure is exactly the one
known to be pass-through, else the wrappers are called as before:
- the outer callable is Dynamo's disable wrapper around `aot_module_simplified`'s unboxed `forward`, with no
  lifted parameters and AOT's `runtime_wrapper` inside it (no dedupe / synthetic-base wrapper between them, only
  the pass-through `SerializableCompiledFunction`);
- the runtime wrapper's inner callable is the `CompiledFxGraph` itself (or it in a `SerializableCompiledFunction`,
  as compiled rather than loaded from the cache): no autograd function (training), no
  subclass, functionalized-RNG or effect-token wrapper, whose presence makes it another object;
- the graph's autotune-bundler context is settled.
The direct call then runs the runtime wrapper's own codegen'd body, with the graph's `current_callable` in
place of the graph: what AOT does for this graph's metadata (grad off, mutations of inputs applied, version
counters bumped, aliased outputs regenerated, autocast off) is done by AOT's code, not reimplemented here.
What is skipped is checked on every call: no Dynamo frame callback is set (the disable wrapper would unset it),
not exporting, no profiler (the records), Inductor's graph-execution recording off. Only the runtime-metrics
flush of `CompiledFxGraph.__call__` is skipped (logging of autotuning metrics, settled by the first call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import torch_internals

# Switched off, every call goes through the wrappers (for A/B measurements and for tests).
enabled = True
# How many region calls took each way (tests read it).
calls = {"direct": 0, "wrapped": 0}

_FORWARD = "aot_module_simplified.<locals>.forward"
_RUNTIME_WRAPPER = "_create_runtime_wrapper.<locals>.runtime_wrapper"
_VARARGS = 0x04  # inspect.CO_VARARGS
_BODY_ARGS = ("_compiled_fn_", "_first_ctx_", "_on_before_call_", "args")  # (torch 2.13's codegen'd body)


def _nothing() -> None:
    pass


def direct(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """`compiled`, called directly past its wrappers from its second call on where that provably changes nothing."""
    parts: tuple[Any, Callable[..., Any], Any] | None = None
    first = True
    callback = torch_internals.get_eval_frame_callback
    profiler = torch_internals.profiler_module
    debug = torch_internals.inductor_debug
    is_exporting = torch.compiler.is_exporting

    def run(*args: Any) -> Any:
        nonlocal parts, first
        if (parts is not None and enabled and callback() is None and not profiler._is_profiler_enabled
                and not debug.RECORD_GRAPH_EXECUTION and not is_exporting()):
            calls["direct"] += 1
            graph, body, first_call = parts
            return body(graph.current_callable, first_call, _nothing, list(args))
        calls["wrapped"] += 1
        out = compiled(*args)
        if first:
            first = False
            parts = take_apart(compiled)
        return out

    return run


def take_apart(compiled: Callable[..., Any]) -> tuple[Any, Callable[..., Any], Any] | None:
    """(the CompiledFxGraph, the runtime wrapper's codegen'd body, its first-call context), or None where the
    wrappers are not exactly the pass-through ones (see the module docstring)."""
    from ..torch_internals import (CompiledFxGraph, SerializableCompiledFunction, aot_autograd_module,
                                   eval_frame_module, runtime_wrappers_module)

    forward = getattr(compiled, "__wrapped__", None)
    if not _is_function(compiled, "_fn", eval_frame_module.__file__):
        return None
    if not _is_function(forward, _FORWARD, aot_autograd_module.__file__) or not forward.__code__.co_flags & _VARARGS:
        return None
    cells = _closure(forward)
    if cells.get("params_buffers_flat", None) != []:
        return None
    wrapper = cells.get("compiled_fn")
    if type(wrapper) is SerializableCompiledFunction:  # (its __call__ calls its compiled_fn: nothing else)
        wrapper = wrapper.compiled_fn
    if not _is_function(wrapper, _RUNTIME_WRAPPER, runtime_wrappers_module.__file__):
        return None
    cells = _closure(wrapper)
    graph, body, first_call = (cells.get(name) for name in
                               ("_inner_compiled_fn", "_codegen_runtime_wrapper", "_first_invocation_ctx"))
    if type(graph) is SerializableCompiledFunction:  # (as compiled, not loaded from AOTAutograd's cache)
        graph = graph.compiled_fn
    if type(graph) is not CompiledFxGraph or graph.current_callable is None or graph._compile_context is not None:
        return None
    if first_call is None or getattr(getattr(body, "__code__", None), "co_varnames", ())[:4] != _BODY_ARGS:
        return None  # (a torch whose runtime wrapper calls its body otherwise)
    return graph, body, first_call


def _is_function(fn: Any, qualname: str, filename: str | None) -> bool:
    code = getattr(fn, "__code__", None)
    return (code is not None and filename is not None and code.co_filename == filename
            and (code.co_qualname == qualname or code.co_qualname.endswith("." + qualname)))


def _closure(fn: Any) -> dict[str, Any]:
    values = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            values[name] = cell.cell_contents
        except ValueError:  # (an empty cell)
            continue
    return values
