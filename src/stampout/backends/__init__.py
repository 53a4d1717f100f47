"""Backends: turn a captured GraphModule into a callable. One file each, one registry.

A backend is any `callable(gm, example_inputs) -> callable(*inputs) -> outputs`, the convention of
torch.compile backends. The names here are built in.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from ..errors import BackendError, message
from ..frames import user_location

Backend = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]

# Imported on first use: AOTAutograd and Inductor take a second to import.
BACKENDS: dict[str, str] = {"eager": "eager", "aot_eager": "aot_eager", "inductor": "inductor"}


def resolve(backend: str | Backend) -> Backend:
    if callable(backend):
        return backend
    module = BACKENDS.get(backend)
    if module is None:
        raise BackendError(message(
            f"unknown backend {backend!r}",
            user_location(),
            f"use one of {sorted(BACKENDS)} or pass a callable(gm, example_inputs) like a torch.compile backend",
        ))
    return importlib.import_module(f"{__name__}.{module}").compile_graph
