"""The permanent patch of `nn.Parameter`'s metadata setters and `torch.utils.swap_tensors`: a write bumps the
compiled functions' epoch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .registry import patch_permanently

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

    why = "a parameter's metadata change bumps the compiled functions' epoch"
    for name in ("data", "requires_grad"):
        descriptor = base.__dict__[name]
        if name not in parameter.__dict__:
            patch_permanently(parameter, name, property(descriptor.__get__, setter(descriptor), doc=descriptor.__doc__),
                              f"torch.nn.Parameter.{name}", why)
    for name in PARAMETER_METADATA_METHODS:
        if name not in parameter.__dict__:
            patch_permanently(parameter, name, method(name), f"torch.nn.Parameter.{name}", why)
    swap = torch.utils.swap_tensors

    @functools.wraps(swap)
    def swap_tensors(t1: Any, t2: Any) -> None:
        try:
            swap(t1, t2)
        finally:
            on_write()

    patch_permanently(torch.utils, "swap_tensors", swap_tensors, "torch.utils.swap_tensors", why)
