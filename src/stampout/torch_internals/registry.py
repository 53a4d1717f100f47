"""The registry the torch_internals submodules share: loading a private torch name with a message that says which
torch stampout needs, and the permanent patches of torch (what may be replaced, and what this process replaced).
A leaf: it imports nothing of stampout, so the package's submodules import it and not the package."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch


def _unsupported(what: str) -> str:
    return (f"stampout needs {what}, which this torch ({torch.__version__}) does not have; "
            "stampout supports torch 2.13 and 2.14: pip install 'torch>=2.13,<2.15'")


def _load(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(_unsupported(f"{module}.{name}")) from error


# What `patch_permanently` may replace (checked per torch release with the package's NAMES: PRIVATE_NAMES).
PATCH_TARGETS = (
    "torch._inductor.codegen.cpp_wrapper_cpu.CppWrapperCpu.codegen_invoke_subgraph",
    "torch._inductor.codecache._precompile_header",
    "torch._inductor.codecache._worker_compile_cpp",
    "torch._inductor.codecache.write",
    "torch._inductor.compile_fx.aot_export_module",
    "torch._functorch.aot_autograd.preserve_rng_state",
    "torch._dynamo.utils.preserve_rng_state",
    "torch._inductor.cpu_vec_isa.VecISA.check_build",
    "torch._inductor.cpu_vec_isa.valid_vec_isa_list",
    "torch.distributed.fsdp._fully_shard._fsdp_param.unsafe_setattr_param",
)


@dataclass(frozen=True)
class Patch:
    """A change stampout makes to torch for the rest of the process: the name it replaced, and why."""

    target: str
    why: str


# Note: permanent patches of torch
# Five features change torch for good once used: `patch_parameter_writes` (nn.Parameter's metadata setters
# and torch.utils.swap_tensors bump the compiled functions' epoch), backends/toolchain.install (Inductor's ISA checks
# memoized), backends/startup.scope (Inductor's header precompiles, skipped where they do not pay, on a thread inside
# stampout's compiles only, built in the background where they do; any build waits for a header still building),
# aoti.enable_aoti_regions (AOTInductor's C++ codegen of invoke_subgraph, one trace per subgraph) and
# fsdp_swaps.install (FSDP2's parameter swaps write parameters without bumping the epoch).
# Each replacement goes through `patch_permanently`: it must name a target of PATCH_TARGETS (checked per torch
# release) or a public one, and PERMANENT_PATCHES lists what this process changed.
PERMANENT_PATCHES: list[Patch] = []


def patch_permanently(owner: Any, name: str, value: Any, target: str, why: str) -> Any:
    """Set `owner.<name>` (the torch name `target`) to `value` for the rest of the process; returns what it held."""
    if target not in PATCH_TARGETS and _private(target):
        raise ValueError(f"{target} is not in torch_internals.PATCH_TARGETS")
    original = getattr(owner, name, None)
    setattr(owner, name, value)
    PERMANENT_PATCHES.append(Patch(target, why))
    return original


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split(".")[1:])
