"""The eager backend: run the GraphModule, calling region subgraphs directly so backward works."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx as fx

from .runner import as_call_modules


def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    return as_call_modules(gm)
