"""Every torch internal stampout depends on that may change between releases, checked at import.

Patched module globals (the `nested_compile_region` placeholder, export's pre-dispatch mode finder), the
`invoke_subgraph` calling convention, and the C++ tensor guards. If a torch release moves one of them,
importing stampout fails here with the name that is missing instead of misbehaving later.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

_REQUIRED = (
    ("torch._higher_order_ops.invoke_subgraph", "invoke_subgraph_placeholder"),
    ("torch._export.utils", "_maybe_find_pre_dispatch_tf_mode_for_export"),
    ("torch._C._dynamo.guards", "TensorGuards"),
    ("torch._functorch.predispatch", "_vmap_increment_nesting"),
)


def _load(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(
            f"stampout needs {module}.{name}, which this torch ({torch.__version__}) does not have; "
            "stampout supports torch 2.13 — install torch==2.13.0"
        ) from error


for _module, _name in _REQUIRED:
    _load(_module, _name)

_INVOKE_MODULE = importlib.import_module("torch._higher_order_ops.invoke_subgraph")
_COMPILER = importlib.import_module("torch.compiler")
if not callable(getattr(_COMPILER, "is_compiling", None)):
    raise ImportError("stampout needs torch.compiler.is_compiling; install torch==2.13.0")
_EXPORT_UTILS = importlib.import_module("torch._export.utils")
TensorGuards = _load("torch._C._dynamo.guards", "TensorGuards")
INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph
_FUNCTION = torch.autograd.function.Function
if not isinstance(_FUNCTION.__dict__.get("apply"), classmethod):
    raise ImportError("stampout needs torch.autograd.Function.apply to be a classmethod; install torch==2.13.0")


_FLAGS = (
    ("deterministic algorithms", torch.are_deterministic_algorithms_enabled),
    ("deterministic algorithms warn only", torch.is_deterministic_algorithms_warn_only_enabled),
    ("float32 matmul precision", torch.get_float32_matmul_precision),
    ("anomaly detection", torch.is_anomaly_enabled),
    ("warn always", torch.is_warn_always_enabled),
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
    return tuple(get() for get in _FLAG_GETTERS)


def invoke_subgraph(graph: fx.Graph, subgraph: fx.Node, name: str, operands: list[Any]) -> fx.Node:
    """Append a region call in torch's calling convention: `invoke_subgraph(get_attr, name, *operands)`;
    its result is a tuple of the subgraph's outputs."""
    return graph.call_function(INVOKE_SUBGRAPH, (subgraph, name, *operands))


def is_region_call(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is INVOKE_SUBGRAPH


def tensor_guards(tensors: list[torch.Tensor]) -> Any:
    """One C++ check of the metadata (shape, strides, dtype, device, requires_grad, dispatch keys) of each
    tensor, in order; `.check(*tensors)`."""
    return TensorGuards(
        *tensors,
        dynamic_dims_sizes=[list(t.shape) for t in tensors],
        dynamic_dims_strides=[list(t.stride()) for t in tensors],
    )


# Note: parameters' metadata is checked after a write, not on every call. A parameter's shape, strides, dtype,
# device and requires_grad change only through its `data` and `requires_grad` setters, `torch.utils.swap_tensors`
# (nn.Module._apply uses all three) and the in-place metadata methods below; on `nn.Parameter` these call
# `on_write` (compiled functions' EPOCH), so a compiled call checks a stack of parameters at the cost of one.
# Not seen: the TensorBase descriptors or aten ops called directly on a parameter (`torch.ops.aten.set_(p, x)`).
PARAMETER_METADATA_METHODS = ("requires_grad_", "detach_", "resize_", "resize_as_", "set_", "as_strided_", "t_",
                              "transpose_", "swapdims_", "swapaxes_", "squeeze_", "unsqueeze_")
_PATCHED_PARAMETER: list[Callable[[], None]] = []


def patch_parameter_writes(on_write: Callable[[], None]) -> None:
    """Make every metadata change of an `nn.Parameter` call `on_write()` (once per process)."""
    if _PATCHED_PARAMETER:
        return
    _PATCHED_PARAMETER.append(on_write)
    parameter, base = torch.nn.Parameter, torch._C.TensorBase

    def setter(descriptor: Any) -> Callable[[Any, Any], None]:
        def set_value(self: Any, value: Any) -> None:
            try:
                descriptor.__set__(self, value)
            finally:
                on_write()

        return set_value

    def method(name: str) -> Callable[..., Any]:
        original = getattr(base, name)

        @functools.wraps(original)
        def changed(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return original(self, *args, **kwargs)
            finally:
                on_write()

        return changed

    for name in ("data", "requires_grad"):
        descriptor = base.__dict__[name]
        if name not in parameter.__dict__:
            setattr(parameter, name, property(descriptor.__get__, setter(descriptor), doc=descriptor.__doc__))
    for name in PARAMETER_METADATA_METHODS:
        if name not in parameter.__dict__:
            setattr(parameter, name, method(name))
    swap = torch.utils.swap_tensors

    @functools.wraps(swap)
    def swap_tensors(t1: Any, t2: Any) -> None:
        try:
            swap(t1, t2)
        finally:
            on_write()

    torch.utils.swap_tensors = swap_tensors


def dict_sentinel(dicts: list[dict]) -> Callable[[], bool]:
    """A C++ check that none of `dicts` was written since now (CPython's per-dict version tags): catches
    writes that bypass `__setattr__` (`m.__dict__[k] = v`, `object.__setattr__(m, k, v)`)."""
    from torch._C._dynamo.guards import RootGuardManager
    from torch._dynamo.guards import GuardManagerType

    root = RootGuardManager()
    holder = {i: d for i, d in enumerate(dicts)}
    for i, d in enumerate(dicts):
        manager = root.dict_getitem_manager(i, f"dicts[{i}]", d, GuardManagerType.GUARD_MANAGER)
        manager.add_dict_version_guard(d, [f"dict_version(dicts[{i}])"], None)
    return functools.partial(root.check, holder)


@contextlib.contextmanager
def capture_hooks(marked_call: Callable, vmap_mode_finder: Callable[[Callable], Callable],
                  function_apply: Callable[[Callable], Callable],
                  capturing: Callable[[], bool]) -> Iterator[None]:
    """For the duration of a capture: `nested_compile_region` functions call `marked_call`, vmap finds
    stampout's mode through `vmap_mode_finder(original finder)`, `torch.autograd.Function.apply` is
    `function_apply(original apply)`, and `torch.compiler.is_compiling()` is true while `capturing()` is
    (libraries take their trace-friendly paths: transformers' MoE experts, masks). The replacements act as
    the originals on threads that are not capturing."""
    saved_placeholder = _INVOKE_MODULE.invoke_subgraph_placeholder
    saved_finder = _EXPORT_UTILS._maybe_find_pre_dispatch_tf_mode_for_export
    saved_apply = _FUNCTION.__dict__["apply"]
    saved_is_compiling = _COMPILER.is_compiling

    @functools.wraps(saved_is_compiling)
    def is_compiling() -> bool:
        return capturing() or saved_is_compiling()

    _INVOKE_MODULE.invoke_subgraph_placeholder = marked_call
    _EXPORT_UTILS._maybe_find_pre_dispatch_tf_mode_for_export = vmap_mode_finder(saved_finder)
    _FUNCTION.apply = classmethod(function_apply(saved_apply.__func__))
    _COMPILER.is_compiling = is_compiling
    try:
        yield
    finally:
        _INVOKE_MODULE.invoke_subgraph_placeholder = saved_placeholder
        _EXPORT_UTILS._maybe_find_pre_dispatch_tf_mode_for_export = saved_finder
        _FUNCTION.apply = saved_apply
        _COMPILER.is_compiling = saved_is_compiling
