"""AOTInductor for programs with regions on torch 2.13: each distinct region compiled once.

Two gaps keep torch 2.13's AOTInductor from it. Its C++ wrapper has no code for invoke_subgraph
(`NotImplementedError: codegen invoke_subgraph is not implemented for cpp wrapper`, fixed upstream after
2.13 by inlining the region at every call). And its AOT path retraces the program without a
`TracingContext`, so invoke_subgraph's per-identifier cache is off: every call becomes a subgraph of its
own and is lowered again. `enable_aoti_regions` closes both: the trace runs in a context (one subgraph per
region), and the region's body is emitted once per enclosing graph as a C++ lambda that each call invokes.
The fixes are applied when the Inductor modules load, so exporting pays no Inductor import, and only where
torch still has the gap.

Outside the regions, most of a small program's package time is fixed: Inductor's vector-ISA checks compile and
load a test program per candidate ISA, one after another, before the first kernel (about 6 s cold on 2 CPUs).
When an AOTInductor compile starts, stampout's toolchain (`backends/toolchain.py`, the same as its Inductor
backend's) checks only the candidates that decide, in the background, with the same verdicts.
"""

from __future__ import annotations

import importlib.abc
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..torch_internals import TracingContext, patch_permanently, tracing
from ..torch_internals import invoke_subgraph_op as invoke_subgraph

log = logging.getLogger(__name__)


def enable_aoti_regions() -> None:
    """Let `torch._inductor.aoti_compile_and_package` compile programs with regions, each distinct region once:
    its body becomes one C++ lambda that every call of it invokes. Idempotent; a no-op on a torch without
    the gaps. `stampout.export` calls it."""
    for name, patch in _AOTI_PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
        elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Applies the AOTInductor fixes to the Inductor modules right after they are first imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _AOTI_PATCHES:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                load = spec.loader.exec_module

                def exec_module(module: Any, load: Callable = load, patch: Callable = _AOTI_PATCHES[fullname]) -> None:
                    load(module)
                    patch(module)

                spec.loader.exec_module = exec_module
                return spec
        return None


def _patch_cpp_wrapper(module: Any) -> None:
    cls = module.CppWrapperCpu
    try:
        stub = "not implemented" in inspect.getsource(cls.codegen_invoke_subgraph)
    except (OSError, TypeError):
        stub = False
    if stub:
        patch_permanently(cls, "codegen_invoke_subgraph", _codegen_invoke_subgraph,
                          "torch._inductor.codegen.cpp_wrapper_cpu.CppWrapperCpu.codegen_invoke_subgraph",
                          "AOTInductor: C++ codegen for invoke_subgraph (one lambda per region)")
        log.info("AOTInductor: C++ codegen for invoke_subgraph installed (one lambda per region)")


def _patch_compile_fx(module: Any) -> None:
    original = module.aot_export_module
    if getattr(original, "_stampout_traced_once", False):
        return

    def aot_export_module(mod: Any, *args: Any, **kwargs: Any) -> Any:
        if _on_cpu(args[0] if args else kwargs.get("args", ())):
            from ..backends import toolchain

            toolchain.warm_up()  # the ISA checks C++ code generation will need, in the background from here
        if TracingContext.try_get() is not None or _region_depth(mod) != 1:
            return original(mod, *args, **kwargs)
        with tracing(TracingContext(None)):  # turns on invoke_subgraph's cache: one trace per subgraph
            return original(mod, *args, **kwargs)

    aot_export_module._stampout_traced_once = True  # type: ignore[attr-defined]
    patch_permanently(module, "aot_export_module", aot_export_module, "torch._inductor.compile_fx.aot_export_module",
                      "AOTInductor: one trace per subgraph (invoke_subgraph's cache on)")


def _on_cpu(example_inputs: Any) -> bool:
    if not isinstance(example_inputs, (list, tuple)):
        return False
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


def _region_depth(mod: Any) -> int:
    """0: no region calls; 1: region calls whose subgraphs call none; 2: nested regions. With nested regions
    torch 2.13's cache hands the inner region's undecomposed trace (from its schema check) to Inductor
    ("both a fallback and a decomp for same op"), so those programs keep torch's trace-per-call."""
    if not isinstance(mod, fx.GraphModule):
        return 0
    calls = [n for m in mod.modules() if isinstance(m, fx.GraphModule)
             for n in m.graph.find_nodes(op="call_function", target=invoke_subgraph)]
    regions = {id(n.graph.owning_module.get_submodule(n.args[0].target)) for n in calls}
    nested = any(id(m) in regions and m.graph.find_nodes(op="call_function", target=invoke_subgraph)
                 for m in mod.modules() if isinstance(m, fx.GraphModule))
    return 2 if nested else 1 if calls else 0


def _codegen_invoke_subgraph(self: Any, call: Any) -> None:
    """C++ for one region call: the region's body is emitted once per enclosing graph as a lambda taking its
    input tensors and filling its outputs; each call declares its outputs and invokes the lambda."""
    from ..torch_internals import EnterSubgraphLine, ExitSubgraphLine
    from ..torch_internals import inductor_ir as ir

    subgraph = call.subgraph
    if not all(isinstance(v, ir.TensorBox) for v in subgraph.graph.graph_inputs.values()) or not all(
            isinstance(o, ir.MultiOutput) for o in call.outputs):
        raise NotImplementedError(f"AOTInductor (with stampout's fix): region {subgraph.name} takes or returns "
                                  "values other than tensors (symbolic sizes, None); export it with tensors only")
    lambdas = self.__dict__.setdefault("_stampout_region_lambdas", {})
    key = (id(self.get_codegened_graph()), subgraph.name)
    if key not in lambdas:
        fn = lambdas[key] = f"{subgraph.name}_lambda{len(lambdas)}"
        ins = [f"{fn}_in{i}" for i in range(len(call.inputs))]
        outs = [f"{fn}_out{i}" for i in range(len(call.outputs))]
        params = [f"AtenTensorHandle {n}" for n in ins] + [f"RAIIAtenTensorHandle& {n}" for n in outs]
        self.writeline(f"auto {fn} = [&]({', '.join(params)}) {{")
        self.writeline(EnterSubgraphLine(self, subgraph.graph))
        self.codegen_subgraph(subgraph, ins, outs)
        self.writeline(ExitSubgraphLine(self))
        self.writeline("};")
    outputs = [out.get_name() for out in call.outputs]
    for name in outputs:
        self.writeline(f"RAIIAtenTensorHandle {name};")
    inputs = [buf.codegen_reference() for buf in call.inputs]
    self.writeline(f"{lambdas[key]}({', '.join(inputs + outputs)});")


_AOTI_PATCHES: dict[str, Callable[[Any], None]] = {
    "torch._inductor.codegen.cpp_wrapper_cpu": _patch_cpp_wrapper,
    "torch._inductor.compile_fx": _patch_compile_fx,
}

__all__ = ["enable_aoti_regions"]
