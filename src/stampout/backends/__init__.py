"""Backends: turn a captured GraphModule into a callable. One file each, one registry.

A backend is any `callable(gm, example_inputs) -> callable(*inputs) -> outputs`, the convention of
torch.compile backends. The names here are built in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx as fx

from ..errors import BackendError, message
from ..frames import user_location
from . import aot_eager, eager, inductor

Backend = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]

BACKENDS: dict[str, Backend] = {
    "eager": eager.compile_graph,
    "aot_eager": aot_eager.compile_graph,
    "inductor": inductor.compile_graph,
}


def resolve(backend: str | Backend) -> Backend:
    if callable(backend):
        return backend
    found = BACKENDS.get(backend)
    if found is None:
        raise BackendError(message(
            f"unknown backend {backend!r}",
            user_location(),
            f"use one of {sorted(BACKENDS)} or pass a callable(gm, example_inputs) like a torch.compile backend",
        ))
    return found
