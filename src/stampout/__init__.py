"""stampout: capture PyTorch programs into torch.fx graphs, tracing each repeated region once."""

from ._logging import configure as _configure_logging
from .api import capture, explain, reset
from .capture import Capture, RegionEvent, RegionStats
from .compiled import CompiledFunction, CompileStats, compile
from .errors import BackendError, CaptureError, ExportError, GuardError, RegionError, StampoutError
from .export import export
from .regions.auto import auto_regions
from .regions.marker import region

_configure_logging()

__all__ = [
    "BackendError",
    "Capture",
    "CompileStats",
    "CompiledFunction",
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
