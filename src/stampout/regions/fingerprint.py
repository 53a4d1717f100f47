"""Fingerprints: the structure of a region call's inputs plus the global state a trace depends on.

A `Fingerprint` is a named tuple of named tuples: it hashes and compares as the plain tuples it is, and
`describe_difference` reads each part by the name it is given here."""

from __future__ import annotations

import enum
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from ..guards.guard import const_key, is_constant
from ..torch_internals import FLAG_NAMES, global_flags
from ..trace.shapes import show_size, size_key
from ..trace.structure import aliases_of, public_names, show_aliases
from ..trace.tensormeta import TensorKind, TensorMeta, tensor_meta
from ..watch.tracking import original_class

_new = tuple.__new__  # a record from a tuple without NamedTuple's keyword __new__ (every region call builds them)
_NO_HOOKS = ((), (), (), ())  # (the global module hooks of state_key when none is registered)


class LeafKind(enum.StrEnum):
    """What an input leaf is, for its part of the fingerprint."""

    TENSOR = "tensor"
    CONSTANT = "constant"
    SIZE = "size"  # a symbolic int, float or bool
    MODULE = "module"
    OBJECT = "object"


class LeafKey(NamedTuple):
    """One input leaf's part of a fingerprint."""

    kind: LeafKind
    value: Any  # TENSOR: its TensorMeta (a TensorKind once sizes are left out); CONSTANT: const_key; SIZE: size_key;
    # MODULE, OBJECT: the class
    detail: Any = ()  # TENSOR: the attributes its caller set on it (`x.scale`); SIZE: its type


class StateKey(NamedTuple):
    """The global state every trace depends on, each part under the name a miss report shows."""

    grad_mode: bool
    autocast_cpu: bool
    autocast_dtype_cpu: torch.dtype
    autocast_cuda: bool
    autocast_dtype_cuda: torch.dtype
    default_dtype: torch.dtype
    global_module_hooks: tuple
    torch_flags: tuple  # global_flags(), named by FLAG_NAMES


class Fingerprint(NamedTuple):
    """Input structure, each leaf's key, the global state, and which leaves are the same object."""

    spec: tuple
    leaves: tuple[tuple, ...]  # LeafKey's fields per leaf, as plain tuples (see leaf_key)
    state: StateKey
    aliases: tuple


_TENSOR, _CONSTANT, _SIZE, _MODULE, _OBJECT = LeafKind  # (module names: an enum member lookup costs per leaf)


_PLAIN_CONSTANTS = frozenset((bool, int, str, type(None)))


def leaf_key(leaf: Any) -> tuple:
    """`LeafKey`'s fields for `leaf`, as a plain tuple (equal to the record; built per leaf on every compiled call,
    where a record costs more; `as_leaf_key` names them for the readers)."""
    t = type(leaf)
    if t in _PLAIN_CONSTANTS:  # (const_key's answer for these exact types: the most common non-tensor leaves)
        return (_CONSTANT, (t, leaf), ())
    if isinstance(leaf, torch.Tensor):
        names = public_names(tuple(leaf.__dict__))  # set by the caller (`x.scale`)
        return (_TENSOR, tensor_meta(leaf, requires_grad=False), names)  # (requires_grad matched separately)
    if is_constant(leaf):
        return (_CONSTANT, const_key(leaf), ())
    if isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return (_SIZE, size_key(leaf), type(leaf))
    if isinstance(leaf, torch.nn.Module):
        return (_MODULE, original_class(leaf), ())
    return (_OBJECT, original_class(leaf), ())


def as_leaf_key(key: tuple) -> LeafKey:
    return _new(LeafKey, key)


def state_key() -> StateKey:
    """Grad mode, autocast, default dtype, global module hooks and torch's global switches: what every trace
    depends on."""
    hooks = torch.nn.modules.module
    registered = (hooks._global_forward_pre_hooks, hooks._global_forward_hooks, hooks._global_backward_pre_hooks,
                  hooks._global_backward_hooks)  # (read per call: torch may rebind them)
    return _new(StateKey, (
        torch.is_grad_enabled(),
        torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
        torch.get_default_dtype(),
        _NO_HOOKS if not any(registered) else tuple(tuple(d.values()) for d in registered),
        global_flags(),
    ))


def fingerprint(spec: tuple, leaves: list[Any]) -> Fingerprint:
    """Input structure, leaf kinds and metadata, which leaves are the same object, and global state."""
    return _new(Fingerprint, (spec, tuple(leaf_key(leaf) for leaf in leaves), state_key(), aliases_of(leaves)))


def without_sizes(key: Fingerprint, leaves: list[Any], masked: frozenset[int] | None = None) -> Fingerprint:
    """A fingerprint with the sizes, strides and storage offsets of tensor leaves in `masked` (all tensor
    leaves when None) left out: what a capture with those inputs symbolic checks by its shape guards."""
    keys = list(key.leaves)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and (masked is None or i in masked):
            meta: TensorMeta = as_leaf_key(keys[i]).value
            kind = TensorKind(meta.cls, leaf.dim(), meta.dtype, meta.device, None, meta.layout)
            keys[i] = as_leaf_key(keys[i])._replace(value=kind)
    return key._replace(leaves=tuple(keys))


def requires_grad_pattern(leaves: list[Any]) -> tuple[bool, ...]:
    return tuple(leaf.requires_grad for leaf in leaves if isinstance(leaf, torch.Tensor))


def show_leaf_key(key: tuple) -> str:
    """A leaf_key as a message shows it: a tensor's metadata, a constant with its type, a class."""
    key = as_leaf_key(key)
    kind, value = key.kind, key.value
    if kind is LeafKind.TENSOR:  # a TensorMeta, or a TensorKind: sizes left out (a symbolic capture checks them)
        return value.show() + (f" with attributes {', '.join(key.detail)}" if key.detail else "")
    if kind is LeafKind.CONSTANT:
        return f"{value[1]!r} ({value[0].__name__})"
    if kind is LeafKind.SIZE:
        return f"symbolic size {show_size(value)}"
    return f"{kind} of class {value.__qualname__}"


_STATE_NAMES = MappingProxyType({"autocast_cpu": "autocast (cpu)", "autocast_dtype_cpu": "autocast dtype (cpu)",
                "autocast_cuda": "autocast (cuda)", "autocast_dtype_cuda": "autocast dtype (cuda)"})


def _cut(value: Any, limit: int = 160) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def describe_difference(expected: Fingerprint, actual: Fingerprint, labels: list[str]) -> str:
    """The first difference between two fingerprints, as a user would read it."""
    if expected.spec != actual.spec:
        return f"argument structure differs: expected {_cut(expected.spec)}, got {_cut(actual.spec)}"
    differing = [(label, a, b) for label, a, b in zip(labels, expected.leaves, actual.leaves) if a != b]
    if differing:
        label, a, b = differing[0]
        more = f" (and {len(differing) - 1} more inputs differ)" if len(differing) > 1 else ""
        return f"{label}: expected {show_leaf_key(a)}, got {show_leaf_key(b)}{more}"
    if expected.aliases != actual.aliases:
        return (f"which arguments are the same object differs: expected {show_aliases(expected.aliases, labels)}, "
                f"got {show_aliases(actual.aliases, labels)}")
    for name, a, b in zip(StateKey._fields[:-1], expected.state, actual.state):
        if a != b:
            return f"{_STATE_NAMES.get(name, name.replace('_', ' '))}: expected {a}, got {b}"
    for name, a, b in zip(FLAG_NAMES, expected.state.torch_flags, actual.state.torch_flags):
        if a != b:
            return f"torch flag {name}: expected {a}, got {b}"
    return "no difference"
