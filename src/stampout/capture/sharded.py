"""FSDP2 (`fully_shard`): a sharded module's hooks run eagerly, its forward is captured as a region.

# Note: where FSDP's collectives enter the program
A module sharded with `fully_shard` has a forward pre-hook that all-gathers its parameters and registers the
unsharded ones on its submodules (plus an autograd function on its inputs that reduce-scatters their
gradients in backward) and a forward hook that reshards them (plus tensor hooks on its outputs that
all-gather again before backward). Those hooks need real tensors and real process groups, and their effects
live on the module objects, so stampout does not trace them: `stampout.compile` runs them **eagerly at the
module boundary** (the module's `nn.Module.__call__`, every hook of it included), and in place of the
module's forward it runs the compiled forward — captured after the pre-hook, so its graph reads the
*unsharded* parameters, resolved per call from their sources (`self.attn.q.weight`). Gradients flow into
the unsharded parameters as in eager, and FSDP's own post-backward reduces them into the sharded ones.

The forward is captured as a region (keyed by its code), so the sharded blocks of a stack — each compiled
on its own, sharing one region cache — are one region trace, stamped out for the others. FSDP's per-module
hook state (`FSDPState._pre_forward`, bound to each module's state) is a per-layer input of that boundary,
not part of the trace: such hooks are guarded by their function (guards.hook_key). A module whose forward calls
sharded modules (the root of a stack) runs its own code eagerly, its children compiled, its unsharded leaf
children (embedding, norm, head) run eagerly in its code (piecewise.py's Note: the glue of a sharded root).
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from ..regions.marker import innermost, region

_ORIGINAL_CALL = nn.Module.__call__
_LOCAL = threading.local()  # .bodies: {id(module): the compiled forward running in its place}


def fsdp_module_class() -> type | None:
    """`FSDPModule`, when torch.distributed.fsdp is imported (nothing is sharded otherwise)."""
    return getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)


def is_sharded(module: Any) -> bool:
    cls = fsdp_module_class()
    return cls is not None and isinstance(module, cls)


def sharded_below(root: nn.Module) -> str | None:
    """The path of the first module below `root` (not `root` itself) sharded with fully_shard, or None."""
    cls = fsdp_module_class()
    if cls is None:
        return None
    for name, m in root.named_modules():
        if name and isinstance(m, cls):
            return name
    return None


def _sharded_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    body = getattr(_LOCAL, "bodies", {}).get(id(self))
    if body is None:  # a call of the module from another thread meanwhile: its plain forward
        return type(self).forward(self, *args, **kwargs)
    return body(*args, **kwargs)


_sharded_forward.__stampout_auto__ = True  # type: ignore[attr-defined]  # transient, as auto regions' marks


def forward_of(module: nn.Module) -> Callable:
    """The forward `nn.Module.__call__` would call (a per-instance one, a region marker, or the class's)."""
    own = module.__dict__.get("forward")
    if own is not None and getattr(own, "__func__", None) is not _sharded_forward:
        return own
    return types.MethodType(type(module).forward, module)


def region_forward(module: nn.Module) -> Callable:
    """The module's forward as a region (its own marker, if it is marked already), bound to the module."""
    forward = forward_of(module)
    if getattr(getattr(forward, "__func__", forward), "__stampout_region__", None) is not None:
        return forward
    # (a marker per capture, kept nowhere: regions are keyed by their code; see regions/marker.py's Note)
    return types.MethodType(region(innermost(type(module).forward)), module)


def call_with_hooks(module: nn.Module, body: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`module(*args, **kwargs)` — its hooks (FSDP's all-gather, reshard and the autograd hooks they register)
    run eagerly — with `body(*args, **kwargs)` called in place of its forward, on the arguments the
    pre-hooks return."""
    bodies = getattr(_LOCAL, "bodies", None)
    if bodies is None:
        bodies = _LOCAL.bodies = {}
    d = module.__dict__
    key = id(module)
    previous_body, previous_forward = bodies.get(key), d.get("forward")
    bodies[key] = body
    d["forward"] = types.MethodType(_sharded_forward, module)  # (the instance dict: not a write of the model)
    try:
        return _ORIGINAL_CALL(module, *args, **kwargs)
    finally:
        if previous_forward is None:
            d.pop("forward", None)
        else:
            d["forward"] = previous_forward
        if previous_body is None:
            bodies.pop(key, None)
        else:
            bodies[key] = previous_body
