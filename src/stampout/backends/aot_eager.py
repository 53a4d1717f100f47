"""aot_eager: AOTAutograd with no compiler, under a TracingContext so shared subgraphs are traced once."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..torch_internals import (
    FakeTensorMode,
    TracingContext,
    aot_module_simplified,
    is_traceable_wrapper_subclass,
    suggest_memory_format,
    tracing,
    without_module_hooks,
)
from .grad_identity import separate_by_requires_grad
from .undifferentiated import detach_undifferentiated_operands
from .inline import inline_regions, inline_writing_regions, subclass_operands
from .whole_region import whole_region

log = logging.getLogger("stampout.backends")

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
    without_module_hooks(gm)

    def run(args: list[Any]) -> Any:
        return gm(*args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


# Note: one compile for the graphs of equal pieces
# The sharded blocks of an FSDP stack are compiled one piece each (sharded.py), and each piece's graph is the
# same code calling the same stamped-out region subgraph: the AOTAutograd compile of the first serves the
# others. Kept per region subgraph (dropped with it), keyed by the graph's code, the functions and subgraphs it
# calls, and its inputs' metadata, aliasing and the grad mode.
_SAME_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _graph_key(gm: fx.GraphModule, example_inputs: list[Any]) -> tuple[Any, tuple] | None:
    subs = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
    if not subs or not all(isinstance(sub, fx.GraphModule) for sub in subs):
        return None
    storages: dict[int, int] = {}
    meta = []
    for t in example_inputs:
        if not isinstance(t, torch.Tensor) or t.layout is not torch.strided or is_traceable_wrapper_subclass(t):
            return None
        sizes = (*t.shape, *t.stride(), t.storage_offset())
        if not all(type(size) is int for size in sizes):
            return None  # (symbolic sizes: compiled for every size, by their capture's shape env)
        storage = storages.setdefault(t.untyped_storage()._cdata, len(storages))
        meta.append((sizes, t.dtype, t.device, t.requires_grad, storage))
    targets = tuple(id(n.target) for n in gm.graph.nodes if n.op == "call_function")  # (the code shows names)
    return subs[0], (gm.code, targets, tuple(map(id, subs)), tuple(meta), torch.is_grad_enabled())


def _fake_mode(gm: fx.GraphModule) -> FakeTensorMode:
    """AOTAutograd's fake mode: with a ShapeEnv (static sizes all the same) where a graph has a while_loop, whose
    fake kernel needs one (Dynamo's fake mode always has one)."""
    loops = any(node.op == "call_function" and node.target is torch.ops.higher_order.while_loop
                for module in gm.modules() if isinstance(module, fx.GraphModule) for node in module.graph.nodes)
    return FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True) if loops else FakeTensorMode()


def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    without_module_hooks(gm)  # (AOTAutograd calls it and its subgraphs while it traces)
    why = subclass_operands(gm)
    if why is not None:  # (see inline.py: invoke_subgraph refuses DTensor operands)
        log.info("aot_eager: region calls inlined (each region compiled once per call): %s", why)
        gm = inline_regions(gm)
    else:
        inline_writing_regions(gm, example_inputs, inputs_too=True)  # (inline.py: writes into inputs at run time)
        detach_undifferentiated_operands(gm)  # (undifferentiated.py: eager's None gradients)
        separate_by_requires_grad(gm)
    key = None if why is not None else _graph_key(gm, example_inputs)
    whole = whole_region(gm) if why is None else None
    if key is not None:
        known = _SAME_GRAPHS.get(key[0], {}).get(key[1])
        if known is not None:
            return known
    context = TracingContext(_fake_mode(gm))
    with tracing(context):
        if whole is not None:  # (whole_region.py: a sharded block's piece)
            compiled = whole.wrap(aot_module_simplified(whole.subgraph, whole.inputs(example_inputs),
                                                        fw_compiler=_boxed_nop, bw_compiler=_boxed_nop))
        else:
            compiled = aot_module_simplified(gm, example_inputs, fw_compiler=_boxed_nop, bw_compiler=_boxed_nop)
    if key is not None:
        _SAME_GRAPHS.setdefault(key[0], {})[key[1]] = compiled
    return compiled
