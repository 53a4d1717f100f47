"""Fingerprints: the structure of a region call's inputs plus the global state a trace depends on."""

from __future__ import annotations

from typing import Any

import torch

from ..guards import const_key, is_constant
from ..shapes import show_size, size_key
from ..structure import aliases_of
from ..tensormeta import TensorKind, tensor_meta
from ..torch_internals import FLAG_NAMES, global_flags
from ..tracking import original_class

_NO_HOOKS = ((), (), (), ())  # (the global module hooks of state_key when none is registered)


def leaf_key(leaf: Any) -> tuple:
    if isinstance(leaf, torch.Tensor):
        names = tuple(k for k in leaf.__dict__ if not k.startswith("_"))  # set by the caller (`x.scale`)
        if names:
            return ("tensor", tensor_meta(leaf, requires_grad=False), names)
        return ("tensor", tensor_meta(leaf, requires_grad=False))  # matched separately (see RegionCalls)
    if is_constant(leaf):
        return ("constant", const_key(leaf))
    if isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("size", type(leaf), size_key(leaf))
    if isinstance(leaf, torch.nn.Module):
        return ("module", original_class(leaf))
    return ("object", original_class(leaf))


def state_key() -> tuple:
    """Grad mode, autocast, default dtype, global module hooks and torch's global switches: what every trace
    depends on."""
    hooks = torch.nn.modules.module
    registered = (hooks._global_forward_pre_hooks, hooks._global_forward_hooks, hooks._global_backward_pre_hooks,
                  hooks._global_backward_hooks)  # (read per call: torch may rebind them)
    return (
        torch.is_grad_enabled(),
        torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
        torch.get_default_dtype(),
        _NO_HOOKS if not any(registered) else tuple(tuple(d.values()) for d in registered),
        global_flags(),
    )


def fingerprint(spec: tuple, leaves: list[Any]) -> tuple:
    """Input structure, leaf kinds and metadata, which leaves are the same object, and global state."""
    return (spec, tuple(leaf_key(leaf) for leaf in leaves), state_key(), aliases_of(leaves))


def without_sizes(key: tuple, leaves: list[Any], masked: frozenset[int] | None = None) -> tuple:
    """A fingerprint with the sizes, strides and storage offsets of tensor leaves in `masked` (all tensor
    leaves when None) left out: what a capture with those inputs symbolic checks by its shape guards."""
    keys = list(key[1])
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and (masked is None or i in masked):
            meta = keys[i][1]
            keys[i] = ("tensor", TensorKind(meta.cls, leaf.dim(), meta.dtype, meta.device, None, meta.layout),
                       *keys[i][2:])
    return (key[0], tuple(keys), *key[2:])


def requires_grad_pattern(leaves: list[Any]) -> tuple[bool, ...]:
    return tuple(leaf.requires_grad for leaf in leaves if isinstance(leaf, torch.Tensor))


def _show(key: tuple) -> str:
    kind, value = key[0], key[1]
    if kind == "tensor":  # a TensorMeta, or a TensorKind: sizes left out (a symbolic capture checks them)
        return value.show() + (f" with attributes {', '.join(key[2])}" if len(key) > 2 else "")
    if kind == "constant":
        return f"{value[1]!r} ({value[0].__name__})"
    if kind == "size":
        return f"symbolic size {show_size(key[2])}"
    return f"{kind} of class {value.__qualname__}"


def _cut(value: Any, limit: int = 160) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def describe_difference(expected: tuple, actual: tuple, labels: list[str]) -> str:
    """The first difference between two fingerprints, as a user would read it."""
    if expected[0] != actual[0]:
        return f"argument structure differs: expected {_cut(expected[0])}, got {_cut(actual[0])}"
    differing = [(label, a, b) for label, a, b in zip(labels, expected[1], actual[1]) if a != b]
    if differing:
        label, a, b = differing[0]
        more = f" (and {len(differing) - 1} more inputs differ)" if len(differing) > 1 else ""
        return f"{label}: expected {_show(a)}, got {_show(b)}{more}"
    if expected[3] != actual[3]:
        return f"which arguments are the same object differs: expected {expected[3]}, got {actual[3]}"
    names = ("grad mode", "autocast (cpu)", "autocast dtype (cpu)", "autocast (cuda)", "autocast dtype (cuda)",
             "default dtype", "global module hooks")
    for name, a, b in zip(names, expected[2], actual[2]):
        if a != b:
            return f"{name}: expected {a}, got {b}"
    for name, a, b in zip(FLAG_NAMES, expected[2][-1], actual[2][-1]):
        if a != b:
            return f"torch flag {name}: expected {a}, got {b}"
    return "no difference"
