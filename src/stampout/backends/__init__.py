"""Backends: turn a captured GraphModule into a callable. One file each, one registry.

A backend is any `callable(gm, example_inputs) -> callable(*inputs) -> outputs`, the convention of
torch.compile backends. The names here are built in.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..errors import BackendError, message
from ..trace.frames import user_location

log = logging.getLogger("stampout.backends")

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
    compile_graph = importlib.import_module(f"{__name__}.{module}").compile_graph
    return compile_graph if module == "eager" else _python_backwards_as_captured(compile_graph)


def python_backwards(gm: fx.GraphModule) -> list[str]:
    """The custom autograd.Functions of the user's whose `apply` the graph calls (trace/recording.py)."""
    return [node.target.__qualname__ for module in gm.modules() if isinstance(module, fx.GraphModule)
            for node in module.graph.nodes
            if node.op == "call_function" and getattr(node.target, "__stampout_python_backward__", False)]


def _python_backwards_as_captured(compile_graph: Backend) -> Backend:
    """A graph trained through a custom autograd.Function of the user's runs as captured (the eager backend's
    runner): its `backward` is Python, which AOTAutograd would run once on fakes while it traces, baking what it
    reads (a global, `ctx.owner.grad_scale`) into the compiled backward; run as captured, the Function's own
    backward runs on every backward pass, reading the world then, as in eager."""

    @functools.wraps(compile_graph)
    def compile_with(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        functions = python_backwards(gm)
        if functions and torch.is_grad_enabled() and any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs):
            from .runner import as_call_modules

            log.info("the graph runs as captured, not through AOTAutograd: it trains through %s, whose backward is "
                     "Python read on every backward pass", ", ".join(sorted(set(functions))))
            return as_call_modules(gm)
        return compile_graph(gm, example_inputs)

    return compile_with


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
