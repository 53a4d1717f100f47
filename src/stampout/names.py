"""Names and sources of the tensors a program can reach: what lifted placeholders are called and where
`cap(...)` finds their live values."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from .sources import Absolute, Attr, Item, Source, module_path


def root_module(fn: Callable) -> torch.nn.Module | None:
    if isinstance(fn, torch.nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


class TensorNames:
    """Placeholder name and source of each tensor the program can reach by name: parameters, buffers and
    tensor attributes of the root module's tree, globals and closure cells of the function. The walk
    only records qualified names; sources are built for the few tensors that get lifted."""

    def __init__(self, fn: Callable) -> None:
        self._found: dict[int, tuple[str, Any, Any]] = {}  # id -> (qualified name, kind, root object)
        root = root_module(fn)
        if root is not None:
            self._walk(root, "", root)
            fn = type(root).forward if fn is root else fn
        func = getattr(fn, "__func__", fn)
        for key, value in list((getattr(func, "__globals__", None) or {}).items()):
            self._add(value, key, "global", func.__globals__)
        code = getattr(func, "__code__", None)
        for var, cell in zip(getattr(code, "co_freevars", ()), getattr(func, "__closure__", None) or ()):
            with contextlib.suppress(ValueError):
                self._add(cell.cell_contents, var, "closure", cell)

    def _add(self, value: Any, name: str, kind: str, root: Any) -> None:
        if isinstance(value, torch.Tensor) and id(value) not in self._found:
            self._found[id(value)] = (name, kind, root)

    def _walk(self, module: torch.nn.Module, prefix: str, root: torch.nn.Module) -> None:
        d = module.__dict__
        for group in (d.get("_parameters", {}), d.get("_buffers", {})):
            for key, value in group.items():
                self._add(value, prefix + key, "module", root)
        for key, value in d.items():
            if isinstance(value, torch.Tensor) and not key.startswith("__"):
                self._add(value, prefix + key, "module", root)
        for key, child in d.get("_modules", {}).items():
            if child is not None:
                self._walk(child, f"{prefix}{key}.", root)

    def find(self, t: torch.Tensor) -> tuple[str, str, Any] | None:
        """(qualified name, kind, root) of a named tensor, or None."""
        return self._found.get(id(t))

    @staticmethod
    def source(found: tuple[str, str, Any]) -> Source:
        name, kind, root = found
        if kind == "module":
            source = module_path(Absolute(root, "self"), name)
        elif kind == "global":
            source = Item(Absolute(root, "globals"), name)
        else:
            source = Attr(Absolute(root, f"closure[{name!r}]"), "cell_contents")
        return source


