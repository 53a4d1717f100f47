"""The module globals of torch a capture replaces while it runs (`capture_hooks`): the `nested_compile_region`
placeholder, export's pre-dispatch mode finder, `Function.apply`, `is_compiling`, higher-order ops' compile
call and `_check_tensor_all_with`, each checked at import.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .registry import _unsupported

_INVOKE_MODULE = importlib.import_module("torch._higher_order_ops.invoke_subgraph")
_COMPILER = importlib.import_module("torch.compiler")
if not callable(getattr(_COMPILER, "is_compiling", None)):
    raise ImportError(_unsupported("torch.compiler.is_compiling"))
_EXPORT_UTILS = importlib.import_module("torch._export.utils")
_HOP_UTILS = importlib.import_module("torch._higher_order_ops.utils")
if not callable(getattr(torch, "_check_tensor_all_with", None)):
    raise ImportError("stampout needs torch._check_tensor_all_with; install torch==2.13.0")
if not callable(getattr(_HOP_UTILS, "_hop_compile_and_call", None)):
    raise ImportError("stampout needs torch._higher_order_ops.utils._hop_compile_and_call; install torch==2.13.0")


_FUNCTION = torch.autograd.function.Function
# torch 2.13: `Function.apply` is a Python classmethod on Function (binding default args, the functorch path);
# torch 2.14: it is `_C._FunctionBase`'s C `classmethod_descriptor`, which calls the module-level
# `_bind_default_args` / `_call_custom_function_call` itself. Either way `_original_apply(cls, ...)` runs it.
_APPLY_ON_FUNCTION = "apply" in _FUNCTION.__dict__
_SAVED_APPLY = _FUNCTION.__dict__.get("apply") if _APPLY_ON_FUNCTION else torch._C._FunctionBase.__dict__.get("apply")
if not isinstance(_SAVED_APPLY, classmethod | types.ClassMethodDescriptorType):
    raise ImportError(_unsupported("torch.autograd.Function.apply as a classmethod"))


def _original_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    return _SAVED_APPLY.__get__(None, cls)(*args, **kwargs)


@contextlib.contextmanager
def capture_hooks(marked_call: Callable, vmap_mode_finder: Callable[[Callable], Callable],
                  function_apply: Callable[[Callable], Callable],
                  capturing: Callable[[], bool]) -> Iterator[None]:
    """For the duration of a capture: `nested_compile_region` functions call `marked_call`, vmap finds
    stampout's mode through `vmap_mode_finder(original finder)`, `torch.autograd.Function.apply` is
    `function_apply(original apply)`, and `torch.compiler.is_compiling()` is true while `capturing()` is
    (libraries take their trace-friendly paths: transformers' MoE experts, masks), and `torch.cond` and the
    other higher-order ops call their op directly instead of compiling it with dynamo (the tracer records
    it), and `torch._check_tensor_all(cond)` is a runtime assert in the graph. The replacements act as the
    originals on threads that are not capturing."""
    saved_placeholder = _INVOKE_MODULE.invoke_subgraph_placeholder
    saved_finder = _EXPORT_UTILS._maybe_find_pre_dispatch_tf_mode_for_export
    saved_is_compiling = _COMPILER.is_compiling
    saved_hop_call = _HOP_UTILS._hop_compile_and_call
    saved_check_all = torch._check_tensor_all_with

    @functools.wraps(saved_is_compiling)
    def is_compiling() -> bool:
        return capturing() or saved_is_compiling()

    @functools.wraps(saved_hop_call)
    def hop_call(fn: Callable, args: tuple, kwargs: dict | None = None) -> Any:
        return fn(*args, **(kwargs or {})) if capturing() else saved_hop_call(fn, args, kwargs)

    @functools.wraps(saved_check_all)
    def check_tensor_all_with(error_type: type, cond: Any, message: Callable[[], str] | None = None) -> None:
        if not capturing() or not isinstance(cond, torch.Tensor) or cond.dtype != torch.bool:
            return saved_check_all(error_type, cond, message)
        torch._assert_async(cond.all(), check_message(message))

    _INVOKE_MODULE.invoke_subgraph_placeholder = marked_call
    _EXPORT_UTILS._maybe_find_pre_dispatch_tf_mode_for_export = vmap_mode_finder(saved_finder)
    _FUNCTION.apply = classmethod(function_apply(_original_apply))
    _COMPILER.is_compiling = is_compiling
    _HOP_UTILS._hop_compile_and_call = hop_call
    torch._check_tensor_all_with = check_tensor_all_with
    try:
        yield
    finally:
        _INVOKE_MODULE.invoke_subgraph_placeholder = saved_placeholder
        _EXPORT_UTILS._maybe_find_pre_dispatch_tf_mode_for_export = saved_finder
        if _APPLY_ON_FUNCTION:
            _FUNCTION.apply = _SAVED_APPLY
        else:
            del _FUNCTION.apply  # torch 2.14: Function inherits the C apply again
        _COMPILER.is_compiling = saved_is_compiling
        _HOP_UTILS._hop_compile_and_call = saved_hop_call
        torch._check_tensor_all_with = saved_check_all


def check_message(message: Any) -> str:
    """The text of a `torch._check*` message for a runtime assert (torch's default where it needs tensor values
    that a capture does not have)."""
    default = "Expected cond to be True, but got False."
    if message is None:
        return default
    if not callable(message):
        return str(message)
    with torch._C.DisableTorchFunction():  # not traced: a message is no part of the program
        try:
            text = str(message())
        except Exception:  # it needs tensor values: unknown while tracing
            return default
    return default if "FakeTensor(" in text else text
