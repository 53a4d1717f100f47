"""Every torch internal stampout depends on that may change between releases, checked at import.

Patched module globals (the `nested_compile_region` placeholder, export's pre-dispatch mode finder), the
`invoke_subgraph` calling convention, and the C++ tensor guards. If a torch release moves one of them,
importing stampout fails here with the name that is missing instead of misbehaving later.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

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


def _unsupported(what: str) -> str:
    return (f"stampout needs {what}, which this torch ({torch.__version__}) does not have; "
            "stampout supports torch 2.13 and 2.14: pip install 'torch>=2.13,<2.15'")


def _load(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(_unsupported(f"{module}.{name}")) from error


for _module, _name in _REQUIRED:
    _load(_module, _name)

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
TensorGuards = _load("torch._C._dynamo.guards", "TensorGuards")
INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph
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


# Note: private torch names are read through this module
# Code elsewhere in stampout imports a private torch name from here (`from .torch_internals import FakeTensor`),
# never from torch itself: `NAMES` maps each name to the torch name it stands for, resolved on first use (Inductor,
# Dynamo and export take seconds to import: a module that imports one inside a function stays lazy). Every private
# torch name stampout uses is in PRIVATE_NAMES (tests/test_dropin.py checks that the source uses no other), checked
# on each supported torch by `missing_private_names()` (CI runs that check on 2.13 and 2.14); the ones whose absence
# would make stampout misbehave rather than fail are also loaded at import above. tests/size_report.py counts the
# private names still used outside this module, and fails when they grow.
NAMES = {
    "AsyncCompile": "torch._inductor.async_compile.AsyncCompile",
    "ConstantAttrMap": "torch._export.passes.lift_constants_pass.ConstantAttrMap",
    "CppBuilder": "torch._inductor.cpp_builder.CppBuilder",
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
    "Generator": "torch._C.Generator",
    "HigherOrderOperator": "torch._ops.HigherOrderOperator",
    "InferenceMode": "torch._C._InferenceMode",
    "LOCK_TIMEOUT": "torch._inductor.codecache.LOCK_TIMEOUT",
    "LazyGraphModule": "torch.fx._lazy_graph_module._LazyGraphModule",
    "LocalSource": "torch._dynamo.source.LocalSource",
    "OpOverload": "torch._ops.OpOverload",
    "OpOverloadPacket": "torch._ops.OpOverloadPacket",
    "TensorBase": "torch._C.TensorBase",
    "TracingContext": "torch._guards.TracingContext",
    "TrainingIRVerifier": "torch._export.verifier.TrainingIRVerifier",
    "aot_module_simplified": "torch._functorch.aot_autograd.aot_module_simplified",
    "cache_dir": "torch._inductor.runtime.cache_dir_utils.cache_dir",
    "check_input_alias_and_mutation_return_outputs": "torch._higher_order_ops.utils.check_input_alias_and_mutation_return_outputs",  # noqa: E501
    "codecache": "torch._inductor.codecache",
    "codecache_write": "torch._inductor.codecache.write",
    "compilation_time_metrics": "torch._dynamo.utils.compilation_time_metrics",
    "compile_fx": "torch._inductor.compile_fx.compile_fx",
    "compile_fx_inner": "torch._inductor.compile_fx.compile_fx_inner",
    "compiling_state_context": "torch._export.utils._compiling_state_context",
    "cpu_vec_isa": "torch._inductor.cpu_vec_isa",
    "detect_fake_mode": "torch._guards.detect_fake_mode",
    "dynamo_counters": "torch._dynamo.utils.counters",
    "dynamo_reset": "torch._dynamo.reset",
    "enter_autocast": "torch.amp.autocast_mode._enter_autocast",
    "enter_inference_mode": "torch.autograd.grad_mode._enter_inference_mode",
    "exit_autocast": "torch.amp.autocast_mode._exit_autocast",
    "exit_inference_mode": "torch.autograd.grad_mode._exit_inference_mode",
    "extract_tensor_metadata": "torch.fx.passes.shape_prop._extract_tensor_metadata",
    "functorch_config": "torch._functorch.config",
    "functorch_vmap_decrement_nesting": "torch._C._functorch._vmap_decrement_nesting",
    "get_compile_threads": "torch._inductor.async_compile.get_compile_threads",
    "get_current_function_mode_stack": "torch.overrides._get_current_function_mode_stack",
    "get_invoke_subgraph_cache": "torch._higher_order_ops.invoke_subgraph.get_invoke_subgraph_cache",
    "get_isa_dry_compile_fingerprint": "torch._inductor.cpu_vec_isa._get_isa_dry_compile_fingerprint",
    "get_lock_dir": "torch._inductor.codecache.get_lock_dir",
    "global_forward_hooks": "torch.nn.modules.module._global_forward_hooks",
    "global_forward_hooks_with_kwargs": "torch.nn.modules.module._global_forward_hooks_with_kwargs",
    "global_forward_pre_hooks": "torch.nn.modules.module._global_forward_pre_hooks",
    "inductor_config": "torch._inductor.config",
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
    "push_saved_tensors_default_hooks": "torch._C._autograd._push_saved_tensors_default_hooks",
    "pytree": "torch.utils._pytree",
    "replace_autocast_with_hop_pass": "torch._export.passes.replace_autocast_with_hop_pass.replace_autocast_with_hop_pass",  # noqa: E501
    "replace_set_grad_with_hop_pass": "torch._export.passes.replace_set_grad_with_hop_pass.replace_set_grad_with_hop_pass",  # noqa: E501
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
    "torch._C._dynamo.guards.RootGuardManager",
    "torch._C._dynamo.guards.TensorGuards",
    "torch._C._get_cudnn_benchmark",
    "torch._C._get_cudnn_deterministic",
    "torch._C._get_cudnn_enabled",
    "torch._C._get_flash_sdp_enabled",
    "torch._C._get_math_sdp_enabled",
    "torch._C._get_mem_efficient_sdp_enabled",
    "torch._C._get_mkldnn_enabled",
    "torch._check_tensor_all_with",
    "torch._dynamo.guards.GuardManagerType",
    "torch._export.utils._maybe_find_pre_dispatch_tf_mode_for_export",
    "torch._functorch.config.patch",
    "torch._higher_order_ops.invoke_subgraph.invoke_subgraph_placeholder",
    "torch.compiler.is_compiling",
    "torch.utils._pytree.tree_leaves",
)
# What `patch_permanently` may replace (checked per torch release with the names above).
PATCH_TARGETS = (
    "torch._inductor.codegen.cpp_wrapper_cpu.CppWrapperCpu.codegen_invoke_subgraph",
    "torch._inductor.codecache._precompile_header",
    "torch._inductor.codecache.write",
    "torch._inductor.compile_fx.aot_export_module",
    "torch._inductor.cpu_vec_isa.VecISA.check_build",
    "torch._inductor.cpu_vec_isa.valid_vec_isa_list",
    "torch.distributed.fsdp._fully_shard._fsdp_param.unsafe_setattr_param",
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


@dataclass(frozen=True)
class Patch:
    """A change stampout makes to torch for the rest of the process: the name it replaced, and why."""

    target: str
    why: str


# Note: permanent patches of torch
# Five features change torch for good once used: `patch_parameter_writes` (below: nn.Parameter's metadata setters
# and torch.utils.swap_tensors bump the compiled functions' epoch), backends/toolchain.install (Inductor's ISA checks
# memoized), backends/startup.scope (Inductor's header precompiles, skipped where they do not pay, on a thread inside
# stampout's compiles only), aoti.enable_aoti_regions (AOTInductor's C++ codegen of invoke_subgraph, one trace per
# subgraph) and fsdp_slots.install (FSDP2's parameter swaps write their slots without bumping the epoch).
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


def missing_private_names() -> list[str]:
    """The names of PRIVATE_NAMES this torch does not have (imports Inductor and export: seconds)."""
    missing = []
    for dotted in PRIVATE_NAMES:
        try:
            resolve_name(dotted)
        except (ImportError, AttributeError):
            missing.append(dotted)
    return missing


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
    return append_node(graph, "call_function", INVOKE_SUBGRAPH, (subgraph, name, *operands))


def _forward_only(module: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    return module.forward(*args, **kwargs)


def without_module_hooks(gm: fx.GraphModule) -> fx.GraphModule:
    """Make `gm` and the graph modules in it run their code without nn.Module's hooks when called. A global
    hook the user registered (`register_module_forward_hook`) is for the user's modules, and ran on them when
    the program was captured; stampout's graphs are no modules of the user's. (A GraphModule's call goes to its
    class's `_wrapped_call`, which `recompile` keeps once set; each GraphModule has a class of its own.)"""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            cls = type(module)
            cls._wrapped_call = staticmethod(_forward_only)
            cls.__call__ = _forward_only  # (a lazy one before its first recompile; recompile keeps the above)
    return gm


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


def fsdp_lazy_init(module: torch.nn.Module) -> None:
    """FSDP2's lazy initialization from `module` (the outermost sharded module): what its first forward's root
    pre-hook does (it finds the root and the shared state `FSDPModule.unshard()` needs). Idempotent."""
    module._get_fsdp_state()._lazy_init()


def patch_fsdp_parameter_swaps(make_swap: Callable[[Callable], Callable]) -> None:
    """FSDP2 swaps parameters in their slots through `make_swap(its function)` from now on (fsdp_slots.py)."""
    target = "torch.distributed.fsdp._fully_shard._fsdp_param.unsafe_setattr_param"
    owner = importlib.import_module(target.rsplit(".", 1)[0])
    if not getattr(owner.unsafe_setattr_param, "__stampout_swap__", False):
        swap = make_swap(owner.unsafe_setattr_param)
        swap.__stampout_swap__ = True
        patch_permanently(owner, "unsafe_setattr_param", swap, target, "its swaps are checked per call, not bumped")


def fsdp_mixed_precision(module: torch.nn.Module) -> bool:
    """Whether a module sharded with fully_shard casts its inputs, parameters or outputs (a MixedPrecisionPolicy)."""
    policy = module._get_fsdp_state()._mp_policy
    return policy.param_dtype is not None or policy.output_dtype is not None or policy.reduce_dtype is not None


# fx.Graph.create_node, without its per-node scan of the arguments for raw SymInts: stampout's arguments never
# hold one (a symbolic size becomes a node first). The private fields it writes are checked once, here; without
# them (another torch), or for a graph whose owning module may carry node hooks, create_node is used.
_PROBE = fx.Graph()
_FAST_NODES = all(hasattr(_PROBE, f) for f in ("_graph_namespace", "_insert", "_find_nodes_lookup_table", "_len",
                                               "_target_to_str", "owning_module")) and all(
    hasattr(_PROBE._graph_namespace, f) for f in ("create_name", "associate_name_with_obj")) and hasattr(
    _PROBE._find_nodes_lookup_table, "insert")
del _PROBE
_NO_KWARGS = fx.immutable_collections.immutable_dict()


def append_node(graph: fx.Graph, op: str, target: Any, args: tuple = (), kwargs: dict | None = None,
                name: str | None = None, after: fx.Node | None = None, before: fx.Node | None = None) -> fx.Node:
    """`graph.create_node(op, target, args, kwargs, name)` at the graph's insertion point (or right after
    `after` / before `before`, as under `graph.inserting_after`/`inserting_before`): the same node, name and
    place, for a few microseconds less per node (a stamped region call emits about ten)."""
    if not _FAST_NODES or graph.owning_module is not None:
        where = (graph.inserting_after(after) if after is not None else graph.inserting_before(before)
                 if before is not None else contextlib.nullcontext())
        with where:
            return graph.create_node(op, target, args, kwargs, name)
    name = graph._graph_namespace.create_name(graph._target_to_str(target) if name is None else name, None)
    node = fx.Node(graph, name, op, target, args, kwargs or _NO_KWARGS, None)
    graph._graph_namespace.associate_name_with_obj(name, node)
    if after is not None:
        after.append(node)
    elif before is not None:
        before.prepend(node)
    else:
        graph._insert(node)
    graph._find_nodes_lookup_table.insert(node)
    graph._len += 1
    return node
