"""The C++ checks a guard uses (TensorGuards over tensors' metadata, dict version tags) and torch's process-wide
flags a fingerprint reads.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._device import DeviceContext

from .native_tensors import dicts_facts
from .registry import _load

TensorGuards = _load("torch._C._dynamo.guards", "TensorGuards")


_FLAGS = (
    # (torch's C getters, where its public function only calls one: each Python frame costs per call)
    ("deterministic algorithms", torch._C._get_deterministic_algorithms),
    ("deterministic algorithms warn only", torch._C._get_deterministic_algorithms_warn_only),
    ("float32 matmul precision", torch._C._get_float32_matmul_precision),
    ("inference mode", torch.is_inference_mode_enabled),  # (beside no_grad: `if torch.is_inference_mode_enabled()`)
    ("anomaly detection", torch.is_anomaly_enabled),
    ("warn always", torch._C._get_warnAlways),
    ("intra-op threads", torch.get_num_threads),
    ("mkldnn enabled", torch._C._get_mkldnn_enabled),
    ("cudnn enabled", torch._C._get_cudnn_enabled),
    ("cudnn deterministic", torch._C._get_cudnn_deterministic),
    ("cudnn benchmark", torch._C._get_cudnn_benchmark),
    ("flash sdp enabled", torch._C._get_flash_sdp_enabled),
    ("mem-efficient sdp enabled", torch._C._get_mem_efficient_sdp_enabled),
    ("math sdp enabled", torch._C._get_math_sdp_enabled),
)
FLAG_NAMES = tuple(name for name, _ in _FLAGS)
_FLAG_GETTERS = tuple(get for _, get in _FLAGS)


def global_flags() -> tuple:
    """torch's process-wide switches that Python code may branch on (`torch.backends.mkldnn.enabled`,
    deterministic algorithms, matmul precision, ...): part of every fingerprint."""
    return tuple(map(operator.call, _FLAG_GETTERS))


# How many TorchFunctionModes / TorchDispatchModes are active: a compiled call asks both (two C calls) and, where
# one is not 0, `caller_modes`.
function_modes = torch._C._len_torch_function_stack
dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode_at = torch._C._get_function_stack_at


def caller_modes() -> bool:
    """Whether a TorchFunctionMode or TorchDispatchMode is active (one a caller holds around a compiled call sees
    every call eagerly, and a compiled graph would bypass it), other than `torch.set_default_device`'s
    DeviceContext."""
    for i in range(function_modes()):
        if type(_function_mode_at(i)) is not DeviceContext:
            return True
    return dispatch_modes() > 0


def tensor_guards(tensors: list[torch.Tensor]) -> Any:
    """One C++ check of the metadata (shape, strides, dtype, device, requires_grad, dispatch keys) of each
    tensor, in order; `.check(*tensors)`."""
    return TensorGuards(
        *tensors,
        dynamic_dims_sizes=[list(t.shape) for t in tensors],
        dynamic_dims_strides=[list(t.stride()) for t in tensors],
    )


def dict_sentinel(dicts: list[dict], lookups: list[tuple[dict, dict[str, Any]]] = (),
                  missing: Any = None) -> Callable[[], bool]:
    """A C++ check that none of `dicts` was written since now (CPython's per-dict version tags): catches
    writes that bypass `__setattr__` (`m.__dict__[k] = v`, `object.__setattr__(m, k, v)`); and that each dict of
    `lookups` still holds the very objects of its names (`missing`: the name is absent), a key lookup each, whatever
    else is written there."""
    from torch._C._dynamo.guards import RootGuardManager
    from torch._dynamo.guards import GuardManagerType

    kind = GuardManagerType.GUARD_MANAGER
    root = RootGuardManager()
    holder = (*dicts, *(d for d, _ in lookups))  # (a tuple's items are read by index in C: half a dict lookup's cost)
    for i, d in enumerate(dicts):
        manager = root.tuple_getitem_manager(i, f"dicts[{i}]", d, kind)
        manager.add_dict_version_guard(d, [f"dict_version(dicts[{i}])"], None)
    for i, (d, names) in enumerate(lookups, len(dicts)):
        manager = root.tuple_getitem_manager(i, f"dicts[{i}]", d, kind)
        for name, value in names.items():
            if value is missing:
                manager.add_dict_contains_guard(False, name, [f"{name!r} not in dicts[{i}]"], None)
            else:
                item = manager.dict_getitem_manager(name, f"dicts[{i}][{name!r}]", value, kind)
                item.add_id_match_guard(id(value), [f"dicts[{i}][{name!r}] is the object read"], None)
    return functools.partial(root.check, holder)


def instance_dicts_sentinel(objects: list[Any]) -> Callable[[], bool]:
    """A C++ check that each of `objects` still has the `__dict__` it has now, unwritten: the dict is read from the
    object on every call (in C, no Python code of it runs), so a dict put in its place (`object.__setattr__(m,
    '__dict__', d)`, which no `__setattr__` sees and which leaves the old dict's version as it was) fails, its
    version tag being another dict's."""
    holder = tuple(objects)
    native = dicts_facts(holder)  # (a few ns an object; Dynamo's tree below about 17)
    if native is not None:
        return native
    from torch._C._dynamo.guards import RootGuardManager
    from torch._dynamo.guards import GuardManagerType

    kind = GuardManagerType.GUARD_MANAGER
    root = RootGuardManager()
    for i, obj in enumerate(holder):
        node = root.tuple_getitem_manager(i, f"objects[{i}]", obj, kind)
        node.get_generic_dict_manager("__dict__", None, kind).add_dict_version_guard(
            obj.__dict__, [f"dict_version(objects[{i}].__dict__)"], None)
    return functools.partial(root.check, holder)


class ObjectFacts:
    """One C++ check (Dynamo's guard manager tree) that objects reached from a tuple of roots are as they were:
    `node(parent, how, key, value)` steps from a node (None: the roots' tuple) by a tuple, list or dict item,
    or into an object's instance `__dict__`; facts on a node: the same object, class, length, dict version.
    Each step reads in C without running Python code of the objects (no `__getattr__`, no `__eq__`)."""

    __slots__ = ("_root", "_kind")

    def __init__(self) -> None:
        from torch._C._dynamo.guards import RootGuardManager
        from torch._dynamo.guards import GuardManagerType

        self._root = RootGuardManager()
        self._kind = GuardManagerType.GUARD_MANAGER

    def node(self, parent: Any, how: str, key: Any, value: Any) -> Any:
        """The node of `value`, found as `parent[key]` (`how`: "tuple", "list", "dict"), as the attribute `key`
        (`how` "attr": read by the C getattr, for objects whose class runs no Python code for it) or, `how`
        "instance dict", as `parent`'s own `__dict__` (key unused)."""
        base = self._root if parent is None else parent
        label = f"{how}[{key!r}]"
        if how == "tuple":
            return base.tuple_getitem_manager(key, label, value, self._kind)
        if how == "list":
            return base.list_getitem_manager(key, label, value, self._kind)
        if how == "dict":
            return base.dict_getitem_manager(key, label, value, self._kind)
        if how == "attr":
            return base.getattr_manager(key, f".{key}", value, self._kind)
        assert how == "instance dict", how
        return base.get_generic_dict_manager("__dict__", None, self._kind)

    @staticmethod
    def same_object(node: Any, value: Any) -> None:
        node.add_id_match_guard(id(value), [f"id {id(value):#x}"], None)  # (the caller keeps `value` alive)

    @staticmethod
    def same_class(node: Any, cls: type) -> None:
        node.add_type_match_guard(id(cls), [f"type {cls.__qualname__}"], None)

    @staticmethod
    def same_length(node: Any, n: int) -> None:
        node.add_length_check_guard(n, [f"len {n}"], None)

    @staticmethod
    def unchanged_dict(node: Any, d: dict) -> None:
        """The dict at `node` is `d`, unwritten: version tags are unique across dicts, so another dict fails."""
        node.add_dict_version_guard(d, ["dict version"], None)

    def check(self, roots: tuple) -> bool:
        return self._root.check(roots)
