"""FSDP2's parameter swaps leave compiled guards valid: the parameters it swaps are checked per call instead.

# Note: FSDP's parameter swaps and the write epoch
FSDP2 swaps the parameters of a sharded module several times a step: its pre-forward hook
puts the unsharded parameter in (`module._parameters[name] = unsharded`), its post-forward hook puts the
sharded one back, and backward does both again. Each of those is a write to a watched module, which bumps
EPOCH (tracking.WriteWatch), so every compiled piece of an FSDP model ran its full guard check and rebuilt
its per-call state on every call.

FSDP makes those writes through one function of its own (`_fsdp_param.unsafe_setattr_param`), which
`install` replaces: the parameter is written without a bump, and remembered as a *swapped parameter* (the first swap
of each does bump, so every entry refreshes knowing it). An entry whose protected guards, lifted
parameters or anchors read a swapped parameter records, when it refreshes, the object it holds, and each
call checks that the module still holds it (a dict lookup and an `is` per parameter) before trusting what its full
check established: the parameter is a per-call input, compared by identity. The unsharded parameter FSDP swaps
in is the same object every step (FSDP frees and re-allocates its storage, which changes no metadata; a
metadata change of a parameter bumps the epoch, torch_internals.patch_parameter_writes), so a sharded
block's call costs its per-call check only. Any other write to such a parameter (the user's `setattr`, a
`module._parameters[name] = p`, `load_state_dict`) bumps as before. While a capture runs on the thread, or
for a module whose class has its own `__setattr__`, FSDP's function runs as it was.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from ..capture.sharded import fsdp_module_class
from ..context import STATE
from ..sources import Attr, CallContext, Source
from ..torch_internals import patch_fsdp_parameter_swaps
from ..watch.classpatch import original
from ..watch.tracking import EPOCH, original_class


class _Swapped:
    """The parameters FSDP swapped so far: by module id, the module (weakly) and the names; every name (a cheap first
    filter of an entry's sources); a generation that moves when a parameter is first swapped (entries look again)."""

    def __init__(self) -> None:
        self.by_module: dict[int, tuple[weakref.ref, set[str]]] = {}
        self.names: set[str] = set()
        self.generation = 0


_SWAPPED = _Swapped()
_MODULE_SETATTR = nn.Module.__setattr__


def install() -> None:
    """Route FSDP2's parameter swaps through `_swapping` (once per process; nothing when FSDP is not loaded)."""
    if fsdp_module_class() is not None:
        patch_fsdp_parameter_swaps(_swapping)


def _swapping(fsdp_setattr: Callable[[nn.Module, str, nn.Parameter], None]) -> Callable:
    def unsafe_setattr_param(module: nn.Module, param_name: str, param: nn.Parameter) -> None:
        if STATE.ctx is not None or original(original_class(module), "__setattr__") is not _MODULE_SETATTR:
            fsdp_setattr(module, param_name, param)  # (a capture's watchers see it; a custom __setattr__ runs)
            return
        key = id(module)
        known = _SWAPPED.by_module.get(key)
        if known is None or known[0]() is not module:
            known = _SWAPPED.by_module[key] = (weakref.ref(module, _forget(key)), set())
        if param_name not in known[1]:
            known[1].add(param_name)
            _SWAPPED.names.add(param_name)
            _SWAPPED.generation += 1
            EPOCH.bump()  # (entries refresh, and check this parameter from now on)
        dict.__setitem__(module.__dict__["_parameters"], param_name, param)

    return unsafe_setattr_param


def _forget(key: int) -> Callable[[weakref.ref], None]:
    def forget(ref: weakref.ref) -> None:
        if _SWAPPED.by_module.get(key, (None,))[0] is ref:
            del _SWAPPED.by_module[key]

    return forget


def swapped(module: Any, name: str) -> bool:
    """Whether `module.<name>` is a parameter FSDP swaps without bumping the epoch."""
    known = _SWAPPED.by_module.get(id(module))
    return known is not None and known[0]() is module and name in known[1]


class SwappedParams:
    """The swapped parameters an entry's cached state read (see the module's Note), found from its protected sources."""

    __slots__ = ("sources", "generation", "steps")

    def __init__(self, sources: list[Source | None]) -> None:
        install()  # (FSDP's swaps are quiet once some entry can check them)
        self.sources = [s for s in sources if s is not None]
        self.generation = 0  # (no parameter swapped yet: none to find)
        self.steps: list[Attr] = []

    def and_held(self, unwritten: Callable[[], bool], ctx: CallContext, memo: dict) -> Callable[[], bool]:
        """`unwritten`, and (where the sources read swapped parameters) each of those is still the object it is
        now."""
        if self.generation != _SWAPPED.generation:
            self.generation = _SWAPPED.generation
            steps: dict[Source, None] = {}
            for source in self.sources:
                while source is not None:
                    if isinstance(source, Attr) and source.attr in _SWAPPED.names:
                        steps[source] = None
                    source = source.base()
            self.steps = list(steps)
        params = []
        for step in self.steps:
            module = step.base().resolve(ctx, memo)
            if swapped(module, step.attr):
                params.append((module.__dict__, step.attr, module.__dict__["_parameters"].get(step.attr)))
        if not params:
            return unwritten

        def held() -> bool:
            if not unwritten():
                return False
            for d, name, value in params:
                if d["_parameters"].get(name) is not value:
                    return False
            return True

        return held
