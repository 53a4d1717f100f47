"""aot_eager: AOTAutograd with no compiler, under a TracingContext so shared subgraphs are traced once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_module_simplified
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensorMode

from .inline import inline_writing_regions

_ATEN = torch.ops.aten


# Note: layouts the fakes got wrong
# AOTAutograd lays out each op's result as its fake kernel does, and drops a `contiguous(memory_format=...)`
# the fakes say is a no-op. Fake and real kernels disagree on the strides of size-1 dims in some views (a
# reshape of a transposed (1, C, H*W) to (1, C, H, W): fake (C*H*W, 1, W*C, C), real (C, 1, W*C, C)), and
# group_norm's kernels, which pick a memory format from the strides and check their input has it, then
# refuse the real tensor (diffusers' VAE). Eager's group_norm makes its input contiguous in the suggested
# format first; so do these.
def _native_group_norm(x: torch.Tensor, *args: Any) -> Any:
    return _ATEN.native_group_norm.default(x.contiguous(memory_format=suggest_memory_format(x)), *args)


def _native_group_norm_backward(grad: torch.Tensor, x: torch.Tensor, *args: Any) -> Any:
    layout = suggest_memory_format(x)
    return _ATEN.native_group_norm_backward.default(grad.contiguous(memory_format=layout),
                                                    x.contiguous(memory_format=layout), *args)


_LAYOUT_TOLERANT = {
    _ATEN.native_group_norm.default: _native_group_norm,
    _ATEN.native_group_norm_backward.default: _native_group_norm_backward,
}


def _tolerate_layouts(gm: fx.GraphModule) -> None:
    """Swap in the layout-tolerant kernels, in `gm` and in its subgraphs (regions, higher-order ops)."""
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        changed = False
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target in _LAYOUT_TOLERANT:
                node.target = _LAYOUT_TOLERANT[node.target]
                changed = True
        if changed:
            module.recompile()


def _boxed_nop(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    _tolerate_layouts(gm)

    def run(args: list[Any]) -> Any:
        return gm(*args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    inline_writing_regions(gm, example_inputs)
    context = torch._guards.TracingContext(FakeTensorMode())
    with torch._guards.tracing(context):
        return aot_module_simplified(gm, example_inputs, fw_compiler=_boxed_nop, bw_compiler=_boxed_nop)
