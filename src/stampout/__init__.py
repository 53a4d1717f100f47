"""stampout: capture PyTorch programs into torch.fx graphs, tracing each repeated region once.

The public names load on first use (they import torch), so `stampout --help` and `--version` stay fast.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from ._logging import configure as _configure_logging

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "Capture",
    "CompileStats",
    "CompiledFunction",
    "CompiledModule",
    "CaptureError",
    "ExportError",
    "GuardError",
    "RegionError",
    "RegionEvent",
    "RegionStats",
    "auto_regions",
    "StampoutError",
    "capture",
    "compile",
    "explain",
    "export",
    "region",
    "reset",
]


# Where each public name is defined (relative module).
_HOMES = {
    "Capture": "capture.result", "RegionEvent": "regions.events", "RegionStats": "regions.events",
    "CompiledFunction": "compile.function", "CompileStats": "compile.function", "CompiledModule": "compile.module",
    "BackendError": "errors", "CaptureError": "errors", "ExportError": "errors", "GuardError": "errors",
    "RegionError": "errors", "StampoutError": "errors",
    "auto_regions": "regions.auto", "region": "regions.marker",
    "capture": "api", "explain": "api", "reset": "api", "compile": "api", "export": "api",
}


def _load() -> None:
    """Bind every public name. All at once, after every import: the subpackages `capture`, `compile`,
    `export` share names with the functions, and importing a submodule binds its name on the package."""
    import importlib

    values = {name: getattr(importlib.import_module(f".{home}", __name__), name) for name, home in _HOMES.items()}
    globals().update(values)


class _Package(types.ModuleType):
    """The package's module type: importing the subpackage `stampout.capture` (or `.compile`,
    `.export`) does not rebind the public name, which stays the function (loaded by `__getattr__`); the subpackage is in
    sys.modules. So code names their modules by import (`from stampout.capture import program`), never as an
    attribute chain (`import stampout.capture.program as p`, `stampout.capture.program.X`, a dotted string given to
    pytest's `monkeypatch.setattr`): those reach the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _HOMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'stampout' has no attribute {name!r}")
    _load()
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:
    from .api import capture, compile, explain, export, reset  # noqa: F401
    from .capture.result import Capture  # noqa: F401
    from .compile.function import CompiledFunction, CompileStats  # noqa: F401
    from .compile.module import CompiledModule  # noqa: F401
    from .errors import BackendError, CaptureError, ExportError, GuardError, RegionError, StampoutError  # noqa: F401
    from .regions.auto import auto_regions  # noqa: F401
    from .regions.events import RegionEvent, RegionStats  # noqa: F401
    from .regions.marker import region  # noqa: F401

_configure_logging()
