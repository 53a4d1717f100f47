"""The public entry points, each defined here: compile(), export(), capture(), explain(), reset().

What they stand on lies below (compile/function.py and compile/module.py for compile, export/program.py for export,
capture/program.py for capture); nothing below imports this module. `stampout/__init__.py` loads it on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from .backends import resolve
from .backends.options import inductor_patches, with_patches
from .capture.arguments import check_call, check_callable
from .capture.program import capture_program
from .capture.result import Capture
from .capture.sharded_boundaries import Boundaries, sharded_modules
from .compile.function import CompiledFunction
from .compile.module import CompiledModule
from .compile.piecewise import Pieces, explain_break
from .errors import CaptureError
from .export.program import export_program
from .trace.structure import flatten_inputs

if TYPE_CHECKING:
    from torch.export import ExportedProgram


def compile(fn: Callable, backend: Any = "inductor", max_entries: int = 8,  # noqa: A001
            regions: str | None = None, dynamic: bool | None = None, *, fullgraph: bool = False,
            mode: str | None = None, options: dict[str, Any] | None = None,
            disable: bool = False) -> CompiledFunction | CompiledModule:
    """Compile `fn` (a function, bound method or `nn.Module`) with stampout's capture and a torch.compile-style
    backend. Takes torch.compile's keywords.

    Example::

        fast = stampout.compile(model)      # an nn.Module: parameters, state_dict, train/eval/to as model's
        y = fast(x)              # first call: capture, compile; later calls: guards, then the compiled code
        print(fast.stats)        # CompileStats(captures=1, traces=1, reuses=0)
        model.forward = stampout.compile(model.forward)   # the Hugging Face recipe: a CompiledFunction

    Args:
        fn: the function, bound method or module.
        backend: "inductor" (the default), "eager", "aot_eager", or any `callable(gm, example_inputs)`.
        max_entries: compiled variants kept (oldest dropped beyond this).
        regions: "auto" marks repeated children of ModuleLists and Sequentials as regions while capturing.
        dynamic: as torch.compile's. None: static first; a call whose inputs differ only in sizes recaptures
            with the dims that changed symbolic, so later sizes reuse it. True: every input dim symbolic from
            the first call (sizes 0 and 1 stay static). False: a capture per shape. Dims marked with
            `torch._dynamo.mark_dynamic` are symbolic in every mode, `mark_static` ones never.
        fullgraph: True raises where stampout would otherwise run a part of the program eagerly.
        mode: torch.compile's modes ("default", "reduce-overhead", "max-autotune",
            "max-autotune-no-cudagraphs"), as the Inductor settings they stand for (CUDA graphs: CUDA only).
        options: a dict of Inductor settings (`torch._inductor.config` names), for the inductor backend.
        disable: True runs `fn` itself on every call (nothing captured), as torch.compile(disable=True).

    Returns:
        A `CompiledModule` (an `nn.Module`) for a module, else a `CompiledFunction`; both have `.stats`,
        `.last_capture` and `.reset()`.

    Raises:
        StampoutError: at once, for arguments that cannot work (a non-callable, an unknown backend or mode).
        CaptureError: at a call with fullgraph=True, for a part of the program that would run eagerly (one it
            cannot capture or guard, a Python side effect a compiled call could not repeat).
    """
    patches = inductor_patches(backend, mode, options)
    resolved = resolve(backend)
    compiled = CompiledFunction(fn, with_patches(resolved, patches) if patches else resolved, max_entries,
                                regions, dynamic, fullgraph=fullgraph, disable=disable)
    compiled.mode = mode
    compiled.options = options
    if isinstance(fn, nn.Module):
        return CompiledModule(fn, compiled)
    return compiled


def export(fn: Callable, *args: Any, dynamic_shapes: Any = None, regions: str | None = None,
           **kwargs: Any) -> ExportedProgram:
    """Capture `fn(*args, **kwargs)` and return it as a `torch.export.ExportedProgram`, regions kept.

    Example::

        ep = stampout.export(model, ids)     # 32 decoder layers whose forward is a stampout.region
        print(len(ep.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)))
        # 32
        print([name for name, _ in ep.graph_module.named_children()])
        # ['repeated_subgraph0']
        torch.export.save(ep, "model.pt2")   # loads and runs in a process that never imports stampout

    Args:
        fn: an `nn.Module` (its parameters and buffers are exported under their state-dict names), a bound
            method of one, or a function (the tensors it reaches become constants of the program).
        *args, **kwargs: example inputs, as for `torch.export.export`.
        dynamic_shapes: as for `torch.export.export` (`Dim` with ranges, `Dim.DYNAMIC`; see the module doc); a
            key that names no argument of `fn` is refused.
        regions: "auto" marks repeated children of ModuleLists and Sequentials as regions (as for `compile`).

    Returns:
        An `ExportedProgram` in torch.export's pre-dispatch IR; each region call is an `invoke_subgraph` over
        a subgraph shared by its equivalent calls. In this process `torch._inductor.aoti_compile_and_package`
        compiles each distinct region once (`stampout.aoti`).

    Raises:
        ExportError: a dim asked to be dynamic that the program specializes, an example outside its `Dim`'s
            range, an input or output that is neither a tensor nor a constant, or an operation that does not
            lower to ATen.
        CaptureError: the program cannot be captured (see `stampout.capture`).
    """
    return export_program(fn, args, kwargs, dynamic_shapes, regions)


def capture(fn: Callable, *args: Any, **kwargs: Any) -> Capture:
    """Capture `fn(*args, **kwargs)` into a `torch.fx.GraphModule`, stamping out repeated regions.

    Example::

        cap = stampout.capture(model, torch.randn(2, 16))
        print(cap.gm.code)        # the graph: inputs, then parameters as placeholders
        y = cap(torch.randn(2, 16))

    Args:
        fn: an `nn.Module` or any callable that runs torch code.
        *args, **kwargs: example inputs; tensors become graph inputs, everything else is baked in.

    Returns:
        A `Capture`: `.gm`, `.stats`, `.events`, `.explain()`, callable like `fn`.

    Raises:
        CaptureError: the program needs tensor values in Python (`if t.sum() > 0`, `.item()`), also where it
            catches that error and goes on (its `except` branch is not what eager runs); it is a generator or
            async function, or returns a generator.
        The program's own exception, unchanged, with the world put back as it was before the call: unlike
        `compile` (which then runs the call eagerly, leaving eager's side effects), `capture` does not run the
        program a second time. Its Python ran on fake tensors, so what it stored before raising may be traced
        values no graph computes (there is no graph: the program did not return), and running it again for
        eager's effects would repeat everything else it did (output, iterator draws) beyond the one run
        `capture` promises.
    """
    check_callable(fn, "capture")
    check_call(fn, args, kwargs, "capture")
    leaves = flatten_inputs(args, kwargs)[0]  # (before the program runs: it may change its input containers)
    if sharded_modules(fn):  # FSDP2: each sharded module's hooks are nodes around its forward
        boundaries = Boundaries(fn, lambda table, f, a, k: Pieces(table, {}, None).run(f, a, k))
        cap = capture_program(fn, args, kwargs, body=lambda *a, **k: boundaries.run(fn, a, k), sharded=True)
    else:
        cap = capture_program(fn, args, kwargs)
    cap.note_constants(leaves)
    return cap


def explain(fn: Callable, *args: Any, **kwargs: Any) -> str:
    """Capture `fn(*args, **kwargs)` and return the per-region-call report; nothing is compiled. A program
    that cannot be captured gets where it breaks and why, and what `stampout.compile` runs eagerly."""
    try:
        cap = capture(fn, *args, **kwargs)
    except CaptureError as error:
        return explain_break(fn, error)
    return cap.explain()


def reset() -> None:
    """Drop every cache stampout keeps: each compiled function's entries, and every memo cache registered in
    `stampout.caches` (compiled functions keep theirs until reset)."""
    from . import caches
    from .compile.function import reset_all

    reset_all()
    caches.clear_all()


__all__ = ["capture", "compile", "explain", "export", "reset"]
