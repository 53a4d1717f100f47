"""FSDP2's private state a sharded capture reads.
"""

from __future__ import annotations

import torch


def fsdp_lazy_init(module: torch.nn.Module) -> None:
    """FSDP2's lazy initialization from `module` (the outermost sharded module): what its first forward's root
    pre-hook does (it finds the root and the shared state `FSDPModule.unshard()` needs). Idempotent."""
    module._get_fsdp_state()._lazy_init()


def fsdp_mixed_precision(module: torch.nn.Module) -> bool:
    """Whether a module sharded with fully_shard casts its inputs, parameters or outputs (a MixedPrecisionPolicy)."""
    policy = module._get_fsdp_state()._mp_policy
    return policy.param_dtype is not None or policy.output_dtype is not None or policy.reduce_dtype is not None
