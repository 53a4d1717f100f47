"""Every torch internal stampout depends on that may change between releases, checked at import.

Patched module globals (the `nested_compile_region` placeholder, export's pre-dispatch mode finder), the
`invoke_subgraph` calling convention, and the C++ tensor guards. If a torch release moves one of them,
importing stampout fails here with the name that is missing instead of misbehaving later.

This package holds NAMES (resolved on first use by `__getattr__`) and PRIVATE_NAMES, and re-exports the
registry (registry.py, a leaf the submodules import: loading names, PATCH_TARGETS, the permanent patches) and
its submodules' names, so code imports every name from `stampout.torch_internals`: hooks (what a capture
replaces while it runs), checks (C++ guards, global flags), graphs (invoke_subgraph, append_node),
parameter_writes (the Parameter patch), fsdp (FSDP2's private state).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

_REQUIRED = (
    ("torch._higher_order_ops.invoke_subgraph", "invoke_subgraph_placeholder"),
    ("torch._export.utils", "_maybe_find_pre_dispatch_tf_mode_for_export"),
    ("torch._C._dynamo.guards", "TensorGuards"),
    ("torch._functorch.predispatch", "_vmap_increment_nesting"),
)


SUPPORTED = ((2, 13), (2, 14))  # torch releases stampout is tested on (pyproject.toml: torch>=2.13,<2.15)
VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])
if VERSION not in SUPPORTED:
    log.warning("stampout is tested on torch 2.13 and 2.14, not on %s: private torch names it uses may have moved",
                torch.__version__)


from .registry import (  # noqa: E402, F401 - the registry's names, re-exported
    PATCH_TARGETS,
    PERMANENT_PATCHES,
    Patch,
    _load,
    _private,
    _unsupported,
    patch_permanently,
)

for _module, _name in _REQUIRED:
    _load(_module, _name)


# Note: private torch names are read through this module
# Code elsewhere in stampout imports a private torch name from here (`from .torch_internals import FakeTensor`),
# never from torch itself: `NAMES` maps each name to the torch name it stands for, resolved on first use (Inductor,
# Dynamo and export take seconds to import: a module that imports one inside a function stays lazy). Every private
# torch name stampout uses is in PRIVATE_NAMES (tests/test_dropin.py checks that the source uses no other), checked
# on each supported torch by `missing_private_names()` (CI runs that check on 2.13 and 2.14); the ones whose absence
# would make stampout misbehave rather than fail are also loaded at import. tests/size_report.py counts the
# private names still used outside this module, and fails when they grow.
NAMES = {
    "AsyncCompile": "torch._inductor.async_compile.AsyncCompile",
    "CompiledFxGraph": "torch._inductor.output_code.CompiledFxGraph",
    "ConstantAttrMap": "torch._export.passes.lift_constants_pass.ConstantAttrMap",
    "CppBuilder": "torch._inductor.cpp_builder.CppBuilder",
    "CppPythonBindingsCodeCache": "torch._inductor.codecache.CppPythonBindingsCodeCache",
    "CppTorchOptions": "torch._inductor.cpp_builder.CppTorchOptions",
    "CppWrapperCodeCache": "torch._inductor.codecache.CppWrapperCodeCache",
    "DataDependentOutputException": "torch._subclasses.fake_tensor.DataDependentOutputException",
    "DimHint": "torch.export.dynamic_shapes._DimHint",
    "DimHintType": "torch.export.dynamic_shapes._DimHintType",
    "DisableTorchFunction": "torch._C.DisableTorchFunction",
    "DynamicOutputShapeException": "torch._subclasses.fake_tensor.DynamicOutputShapeException",
    "EnterSubgraphLine": "torch._inductor.codegen.wrapper.EnterSubgraphLine",
    "ExitSubgraphLine": "torch._inductor.codegen.wrapper.ExitSubgraphLine",
    "FakeTensor": "torch._subclasses.fake_tensor.FakeTensor",
    "FakeTensorMode": "torch._subclasses.fake_tensor.FakeTensorMode",
    "FileLock": "torch.utils._filelock.FileLock",
    "FunctionSchema": "torch._C.FunctionSchema",
    "GraphPickler": "torch.fx._graph_pickler.GraphPickler",
    "GraphPicklerOptions": "torch.fx._graph_pickler.Options",
    "Generator": "torch._C.Generator",
    "HigherOrderOperator": "torch._ops.HigherOrderOperator",
    "InferenceMode": "torch._C._InferenceMode",
    "LOCK_TIMEOUT": "torch._inductor.codecache.LOCK_TIMEOUT",
    "LambdaFuture": "torch._inductor.codecache.LambdaFuture",
    "LazyGraphModule": "torch.fx._lazy_graph_module._LazyGraphModule",
    "LocalSource": "torch._dynamo.source.LocalSource",
    "OpOverload": "torch._ops.OpOverload",
    "OpOverloadPacket": "torch._ops.OpOverloadPacket",
    "SerializableCompiledFunction": "torch._functorch._aot_autograd.runtime_wrappers.SerializableCompiledFunction",
    "TensorBase": "torch._C.TensorBase",
    "TracingContext": "torch._guards.TracingContext",
    "TrainingIRVerifier": "torch._export.verifier.TrainingIRVerifier",
    "aot_autograd_module": "torch._functorch.aot_autograd",
    "aot_module_simplified": "torch._functorch.aot_autograd.aot_module_simplified",
    "cache_dir": "torch._inductor.runtime.cache_dir_utils.cache_dir",
    "check_input_alias_and_mutation_return_outputs": "torch._higher_order_ops.utils.check_input_alias_and_mutation_return_outputs",  # noqa: E501
    "codecache": "torch._inductor.codecache",
    "codecache_write": "torch._inductor.codecache.write",
    "compilation_time_metrics": "torch._dynamo.utils.compilation_time_metrics",
    "compile_fx": "torch._inductor.compile_fx.compile_fx",
    "dynamo_compile_lock": "torch._dynamo.convert_frame.compile_lock",
    "compile_fx_inner": "torch._inductor.compile_fx.compile_fx_inner",
    "compiling_state_context": "torch._export.utils._compiling_state_context",
    "cpu_vec_isa": "torch._inductor.cpu_vec_isa",
    "detect_fake_mode": "torch._guards.detect_fake_mode",
    "disabled_torch_function_impl": "torch._C._disabled_torch_function_impl",
    "dynamo_counters": "torch._dynamo.utils.counters",
    "dynamo_utils_module": "torch._dynamo.utils",
    "dynamo_reset": "torch._dynamo.reset",
    "enter_autocast": "torch.amp.autocast_mode._enter_autocast",
    "enter_inference_mode": "torch.autograd.grad_mode._enter_inference_mode",
    "exit_autocast": "torch.amp.autocast_mode._exit_autocast",
    "exit_inference_mode": "torch.autograd.grad_mode._exit_inference_mode",
    "eval_frame_module": "torch._dynamo.eval_frame",
    "extract_tensor_metadata": "torch.fx.passes.shape_prop._extract_tensor_metadata",
    "functorch_config": "torch._functorch.config",
    "functorch_vmap_decrement_nesting": "torch._C._functorch._vmap_decrement_nesting",
    "get_compile_threads": "torch._inductor.async_compile.get_compile_threads",
    "get_current_function_mode_stack": "torch.overrides._get_current_function_mode_stack",
    "get_eval_frame_callback": "torch._C._dynamo.eval_frame.get_eval_frame_callback",
    "get_invoke_subgraph_cache": "torch._higher_order_ops.invoke_subgraph.get_invoke_subgraph_cache",
    "get_isa_dry_compile_fingerprint": "torch._inductor.cpu_vec_isa._get_isa_dry_compile_fingerprint",
    "get_lock_dir": "torch._inductor.codecache.get_lock_dir",
    "global_forward_hooks": "torch.nn.modules.module._global_forward_hooks",
    "global_forward_hooks_with_kwargs": "torch.nn.modules.module._global_forward_hooks_with_kwargs",
    "global_forward_pre_hooks": "torch.nn.modules.module._global_forward_pre_hooks",
    "inductor_config": "torch._inductor.config",
    "inductor_debug": "torch._inductor.debug",
    "inductor_ir": "torch._inductor.ir",
    "invoke_subgraph_op": "torch._higher_order_ops.invoke_subgraph.invoke_subgraph",
    "is_any_autocast_enabled": "torch._C._is_any_autocast_enabled",
    "is_functorch_wrapped_tensor": "torch._C._functorch.is_functorch_wrapped_tensor",
    "is_torch_function_mode_enabled": "torch._C._is_torch_function_mode_enabled",
    "is_traceable_wrapper_subclass": "torch.utils._python_dispatch.is_traceable_wrapper_subclass",
    "lazy_load_decompositions": "torch._functorch.predispatch.lazy_load_decompositions",
    "lift_constants_pass": "torch._export.passes.lift_constants_pass.lift_constants_pass",
    "maybe_current_level": "torch._C._functorch.maybe_current_level",
    "normalize_path_separator": "torch._inductor.cpp_builder.normalize_path_separator",
    "peek_interpreter_stack": "torch._C._functorch.peek_interpreter_stack",
    "pop_saved_tensors_default_hooks": "torch._C._autograd._pop_saved_tensors_default_hooks",
    "push_saved_tensors_default_hooks": "torch._C._autograd._push_saved_tensors_default_hooks",
    "pytree": "torch.utils._pytree",
    "profiler_module": "torch.autograd.profiler",
    "replace_autocast_with_hop_pass": "torch._export.passes.replace_autocast_with_hop_pass.replace_autocast_with_hop_pass",  # noqa: E501
    "replace_set_grad_with_hop_pass": "torch._export.passes.replace_set_grad_with_hop_pass.replace_set_grad_with_hop_pass",  # noqa: E501
    "runtime_metrics_context": "torch._dynamo.utils.get_runtime_metrics_context",
    "runtime_wrappers_module": "torch._functorch._aot_autograd.runtime_wrappers",
    "set_default_dtype": "torch._C._set_default_dtype",
    "set_deterministic_algorithms": "torch._C._set_deterministic_algorithms",
    "set_grad_enabled": "torch._C._set_grad_enabled",
    "suggest_memory_format": "torch._prims_common.suggest_memory_format",
    "sympy_functions": "torch.utils._sympy.functions",
    "sympy_numbers": "torch.utils._sympy.numbers",
    "torch_key": "torch._inductor.codecache.torch_key",
    "top_saved_tensors_default_hooks": "torch._C._autograd._top_saved_tensors_default_hooks",
    "torch_assert": "torch._assert",
    "torch_assert_async": "torch._assert_async",
    "tracing": "torch._guards.tracing",
    "unset_fake_temporarily": "torch._subclasses.fake_tensor.unset_fake_temporarily",
    "use_lazy_graph_module": "torch.fx._lazy_graph_module._use_lazy_graph_module",
    "vmap_decrement_nesting": "torch._functorch.predispatch._vmap_decrement_nesting",
    "vmap_increment_nesting": "torch._functorch.predispatch._vmap_increment_nesting",
    "x86_isa_checker": "torch._inductor.cpu_vec_isa.x86_isa_checker",
}
_USED_HERE = (  # (and in the modules tests/size_baseline.json still lists)
    "torch.fx.graph_module._WrappedCall",
    "torch._C._FunctionBase",
    "torch._C._InferenceMode.__dict__",
    "torch._C._autograd",
    "torch.Tensor._make_subclass",
    "torch._C._set_throw_on_mutable_data_ptr",
    "torch._C._set_warn_deprecated_on_mutable_data_ptr",
    "torch._C._dynamo.guards.RootGuardManager",
    "torch._C._dynamo.guards.TensorGuards",
    "torch._C._get_cudnn_benchmark",
    "torch._C._get_function_stack_at",
    "torch._C._len_torch_dispatch_stack",
    "torch._C._len_torch_function_stack",
    "torch.utils._device.DeviceContext",
    "torch._C._get_cudnn_deterministic",
    "torch._C._get_cudnn_enabled",
    "torch._C._get_deterministic_algorithms",
    "torch._C._get_deterministic_algorithms_warn_only",
    "torch._C._get_float32_matmul_precision",
    "torch._C._get_warnAlways",
    "torch._C._get_flash_sdp_enabled",
    "torch._C._get_math_sdp_enabled",
    "torch._C._get_mem_efficient_sdp_enabled",
    "torch._C._get_mkldnn_enabled",
    "torch._check_tensor_all_with",
    "torch._dynamo.guards.GuardManagerType",
    "torch._export.utils._maybe_find_pre_dispatch_tf_mode_for_export",
    "torch._functorch.config.patch",
    "torch._subclasses.fake_tensor.FakeTensorConfig",
    "torch._higher_order_ops.invoke_subgraph.invoke_subgraph_placeholder",
    "torch.compiler.is_compiling",
    "torch.utils._pytree.tree_leaves",
    "torch.autograd.profiler._is_profiler_enabled",
)
PRIVATE_NAMES = (*NAMES.values(), *_USED_HERE, *PATCH_TARGETS)


def resolve_name(dotted: str) -> Any:
    """The object a dotted name denotes: its longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def __getattr__(name: str) -> Any:
    """A name of `NAMES`, resolved (and kept) on first use."""
    dotted = NAMES.get(name)
    if dotted is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        value = resolve_name(dotted)
    except (ImportError, AttributeError) as error:
        raise ImportError(_unsupported(dotted)) from error
    globals()[name] = value
    return value


def missing_private_names() -> list[str]:
    """The names of PRIVATE_NAMES this torch does not have (imports Inductor and export: seconds)."""
    missing = []
    for dotted in PRIVATE_NAMES:
        try:
            resolve_name(dotted)
        except (ImportError, AttributeError):
            missing.append(dotted)
    return missing


# The package's public names, from the submodules that own them (after the registry above: they import it).
from .checks import (  # noqa: E402, F401
    FLAG_NAMES,
    ObjectFacts,
    TensorGuards,
    caller_modes,
    dict_sentinel,
    dispatch_modes,
    function_modes,
    global_flags,
    instance_dicts_sentinel,
    tensor_guards,
)
from .fakes import FakeMaker  # noqa: E402, F401
from .fsdp import fsdp_cast_dtypes, fsdp_lazy_init, patch_fsdp_parameter_swaps  # noqa: E402, F401
from .graphs import INVOKE_SUBGRAPH, append_node, invoke_subgraph, is_region_call, without_module_hooks  # noqa: E402, F401
from .hooks import capture_hooks, check_message  # noqa: E402, F401
from .native_tensors import grad_free, is_native, tensor_check  # noqa: E402, F401
from .parameter_writes import PARAMETER_METADATA_METHODS, patch_parameter_writes  # noqa: E402, F401
