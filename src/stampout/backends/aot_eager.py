"""aot_eager: AOTAutograd with no compiler, under a TracingContext so shared subgraphs are traced once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_module_simplified
from torch._subclasses.fake_tensor import FakeTensorMode


def _boxed_nop(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    def run(args: list[Any]) -> Any:
        return gm(*args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    context = torch._guards.TracingContext(FakeTensorMode())
    with torch._guards.tracing(context):
        return aot_module_simplified(gm, example_inputs, fw_compiler=_boxed_nop, bw_compiler=_boxed_nop)
