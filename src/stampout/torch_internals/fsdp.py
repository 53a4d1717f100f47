"""FSDP2's private state a sharded capture reads.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from .registry import patch_permanently


def fsdp_lazy_init(module: torch.nn.Module) -> None:
    """FSDP2's lazy initialization from `module` (the outermost sharded module): what its first forward's root
    pre-hook does (it finds the root and the shared state `FSDPModule.unshard()` needs). Idempotent."""
    module._get_fsdp_state()._lazy_init()


def fsdp_cast_dtypes(module: torch.nn.Module) -> tuple[torch.dtype | None, torch.dtype | None]:
    """The dtypes a module sharded with fully_shard casts its floating-point inputs and outputs to (its
    MixedPrecisionPolicy: `param_dtype` where `cast_forward_inputs`, and `output_dtype`), None where it does not."""
    policy = module._get_fsdp_state()._mp_policy
    return (policy.param_dtype if policy.cast_forward_inputs else None), policy.output_dtype


def patch_fsdp_parameter_swaps(make_swap: Callable[[Callable], Callable]) -> None:
    """FSDP2 swaps parameters through `make_swap(its function)` from now on (fsdp_swaps.py)."""
    target = "torch.distributed.fsdp._fully_shard._fsdp_param.unsafe_setattr_param"
    owner = importlib.import_module(target.rsplit(".", 1)[0])
    if not getattr(owner.unsafe_setattr_param, "__stampout_swap__", False):
        swap = make_swap(owner.unsafe_setattr_param)
        swap.__stampout_swap__ = True
        patch_permanently(owner, "unsafe_setattr_param", swap, target, "its swaps are checked per call, not bumped")
