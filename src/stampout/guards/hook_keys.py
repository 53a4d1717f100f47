"""What a guard on a module's hooks compares: each hook as an identity, by function, or by code and closure."""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..watch.tracking import HOOK_DICTS

# How a module call runs each forward hook, kept beside the hook dicts by its handle's id: with the call's kwargs, and
# (forward hooks) after an exception too. A write into one of them changes the call as much as a new hook does.
_HOOK_FLAGS = {"_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
               "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")}


def hooks_key(module: torch.nn.Module) -> tuple:
    """The hooks a module call would run (as identities; see `hook_key`), each with how it is run (`Flagged`)."""
    d = module.__dict__
    return tuple(_keys(d, name) if d.get(name) else () for name in HOOK_DICTS)


def _keys(d: dict, name: str) -> tuple:
    hooks = d[name]
    flags = [f for f in (d.get(n) for n in _HOOK_FLAGS.get(name, ())) if f is not None]
    if not any(flags):
        return tuple(map(hook_key, hooks.values()))
    return tuple(Flagged(hook_key(h), tuple(k in f for f in flags)) if any(k in f for f in flags) else hook_key(h)
                 for k, h in hooks.items())


@dataclass(frozen=True)
class Flagged:
    """A forward hook run with the call's kwargs or always called (`flags`, in `_HOOK_FLAGS` order)."""

    hook: Any
    flags: tuple


# Note: hooks guarded by their function
# FSDP2's hooks are bound methods of a per-module FSDPState; stampout runs them eagerly around the captured
# forward of a sharded module (sharded.py), never inside a trace, so the state they are bound to is a per-call
# input of that boundary: they are compared by function, and one trace serves every sharded layer. Any other
# hook may be traced, so it is compared by identity.
_EAGER_HOOK_OWNERS = frozenset({"torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState"})


# Tensor parallelism's hooks are lambdas of `distribute_module`, one per module, closing over the style's
# bound `_prepare_input_fn` / `_prepare_output_fn` (a partial with the layouts) and the DeviceMesh: what they
# do is a function of those values, so they are compared by code and closure values (the style's fields).
_TP_HOOK = ("distribute_module.<locals>.<lambda>", os.path.join("torch", "distributed", "tensor", "_api.py"))


def hook_key(hook: Any) -> Any:
    """What a guard on a module's hooks compares of one hook: the hook itself; for a hook stampout never
    traces (FSDP's, or the per-module wrappers grouped `fully_shard([a, b])` makes of them), its function; for
    tensor parallelism's, its code and closure values."""
    inner, depth = hook, 0
    while inner is not None and depth < 4:  # (functools.wraps chains: `__wrapped__`)
        owner = getattr(inner, "__self__", None)
        if owner is not None:
            cls = type(owner)
            if f"{cls.__module__}.{cls.__qualname__}" in _EAGER_HOOK_OWNERS:
                return inner.__func__
        inner, depth = getattr(inner, "__wrapped__", None), depth + 1
    code = getattr(hook, "__code__", None)
    if code is not None and code.co_qualname == _TP_HOOK[0] and code.co_filename.endswith(_TP_HOOK[1]):
        return HookByValue(code, tuple(_closure_value(cell.cell_contents) for cell in hook.__closure__ or ()))
    return hook


@dataclass(frozen=True)
class HookByValue:
    """A hook compared by its code and the values it closes over (see `hook_key`)."""

    code: Any
    closure: tuple

    def describe(self) -> str:
        return f"{self.code.co_qualname} (compared by value)"


def _closure_value(value: Any) -> Any:
    if isinstance(value, functools.partial):
        fn, owner = getattr(value.func, "__func__", value.func), getattr(value.func, "__self__", None)
        state = None if owner is None else (type(owner), tuple(sorted(vars(owner).items())))
        return (fn, state, value.args, tuple(sorted(value.keywords.items())))
    mesh = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
    if mesh is not None and isinstance(value, mesh):
        return value  # a DeviceMesh compares by value (its ranks, layout and dim names): `mesh["tp"]` makes new ones
    return _Same(value)


class _Same:
    """Equal to another `_Same` of the very same object."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def describe_hooks(observed: tuple) -> str:
    """The hooks `hooks_key` saw, by name and owner (what differs between two calls shows)."""
    parts = [f"{label} [{', '.join(map(_hook_name, hooks))}]"
             for label, hooks in zip(("pre", "fwd", "bwd-pre", "bwd"), observed) if hooks]
    return "hooks " + "; ".join(parts)


def _hook_name(hook: Any) -> str:
    if isinstance(hook, Flagged):
        return f"{_hook_name(hook.hook)} (flags {hook.flags})"
    if isinstance(hook, HookByValue):
        return hook.describe()
    name = getattr(hook, "__qualname__", None)
    owner = getattr(hook, "__self__", None)
    if name is None:
        return f"<{type(hook).__name__} object at {id(hook):#x}>"
    if owner is not None:
        return f"{name} of <{type(owner).__name__} object at {id(owner):#x}>"
    return f"{name} at {id(hook):#x}"


NO_HOOKS = ((), (), (), ())


def no_hooks(module: torch.nn.Module) -> bool:
    d = module.__dict__
    return not (d.get("_forward_pre_hooks") or d.get("_forward_hooks") or d.get("_backward_pre_hooks")
                or d.get("_backward_hooks"))
