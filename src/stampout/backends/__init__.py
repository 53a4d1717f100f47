"""Backends: turn a captured GraphModule into a callable. One file each, one registry.

A backend is any `callable(gm, example_inputs) -> callable(*inputs) -> outputs`, the convention of
torch.compile backends. The names here are built in.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from ..errors import BackendError, message
from ..trace.frames import user_location

Backend = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]

# Imported on first use: AOTAutograd and Inductor take a second to import.
BACKENDS: dict[str, str] = {"eager": "eager", "aot_eager": "aot_eager", "inductor": "inductor"}


def resolve(backend: str | Backend) -> Backend:
    if callable(backend):
        return _user_backend(backend)
    module = BACKENDS.get(backend)
    if module is None:
        raise BackendError(message(
            f"unknown backend {backend!r}",
            user_location(),
            f"use one of {sorted(BACKENDS)} or pass a callable(gm, example_inputs) like a torch.compile backend",
        ))
    return importlib.import_module(f"{__name__}.{module}").compile_graph


def _user_backend(backend: Backend) -> Backend:
    """A user's backend, as given; when what it returns is the GraphModule itself (`return gm`), its region
    calls run as plain module calls: invoke_subgraph's autograd needs a fake mode outside tracing."""
    from .runner import INVOKE_SUBGRAPH, as_call_modules

    @functools.wraps(backend)
    def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compiled = backend(gm, example_inputs)
        module = getattr(compiled, "__self__", compiled)  # `return gm` or `return gm.forward`
        if isinstance(module, fx.GraphModule) and module.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH):
            return as_call_modules(module)
        return compiled

    return compile_graph
