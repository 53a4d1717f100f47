"""What the tracer asks of the region handler it is built with (regions/call.py's `RegionCalls` implements it).

A leaf of the import graph: the tracer and its parts (fakes.py, recording.py) name the protocol, the region
handler provides it, and neither imports the other for it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.fx as fx

from .builder import Builder


class RegionHooks(Protocol):
    """What the tracer asks of the region handler."""

    def lift_into_subgraph(self, builder: Builder, t: torch.Tensor) -> fx.Node: ...

    def note_root_lift(self, t: torch.Tensor) -> None: ...

    def note_autograd_read(self) -> None: ...

    def note_value_decision(self, scope: frozenset[int]) -> None: ...

    def note_hook(self, reason: str) -> None: ...

    def run_branch(self, fn: Any, inputs: list[Any], op: str) -> Any: ...

    def note_unguarded_read(self, reason: str) -> None: ...

    def note_torch_arguments(self, args: tuple, kwargs: dict) -> None: ...

    def lift_symbol(self, builder: Builder, symbol: Any) -> fx.Node: ...

    def frame_ids(self) -> frozenset[int]: ...

    def hooks_set(self) -> bool:
        """Whether its trace or profile function is set now (the tracer then calls torch without them)."""
        ...
