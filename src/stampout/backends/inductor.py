"""inductor: `compile_fx`, each distinct region subgraph compiled once.

torch 2.13's Inductor computes wrong gradients for reused subgraphs in training when it reuses buffers
(see TORCH_NOTES.md: 31-39 % relative error on the layer norm weights of a reused block). When a graph has
region calls and will be differentiated, stampout compiles it with `allow_buffer_reuse=False`, which
gives correct gradients; inference and flat graphs keep buffer reuse.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..runner import INVOKE_SUBGRAPH

log = logging.getLogger("stampout.backends")

# Set to False only to reproduce the torch bug (the regression test does).
AVOID_REUSED_SUBGRAPH_BUFFER_BUG = True


def has_region_calls(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target is INVOKE_SUBGRAPH for n in gm.graph.nodes)


def needs_workaround(gm: fx.GraphModule, example_inputs: list[Any]) -> bool:
    trains = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
    )
    return trains and has_region_calls(gm)


def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    patches: dict[str, Any] = {}
    if AVOID_REUSED_SUBGRAPH_BUFFER_BUG and needs_workaround(gm, example_inputs):
        patches["allow_buffer_reuse"] = False
        log.info("inductor: training a graph with region calls; compiling with allow_buffer_reuse=False "
                 "(torch 2.13 returns wrong gradients for reused subgraphs otherwise)")
    return compile_fx(gm, example_inputs, config_patches=patches or None)
