"""`export`: a captured program as a `torch.export.ExportedProgram` that keeps its regions.

Non-strict torch.export inlines every `invoke_subgraph` it meets, and strict export runs Dynamo over every
layer again. stampout already holds the program as a torch-level FX graph whose region calls share subgraph
modules, so the exported program is built from that graph (lowered to ATen by `lowering.py`) and given what
torch.export gives its own: placeholders in its order and naming (`p_layers_0_mlp_up_proj_weight`) with
state-dict names as targets, a graph signature, lifted constants, input and output specs. The program saves,
loads and runs without stampout; `aoti.py` lets AOTInductor compile each of its regions once.

Dynamic shapes: `dynamic_shapes` as torch.export takes it (`Dim("t", min=, max=)`, `Dim.DYNAMIC`) and
`torch._dynamo.mark_dynamic` make those input dims symbols of the capture (shapes.py); the program is lowered
with them, each region still traced once, and `range_constraints` carry the ranges the capture allows, so
`ep.module()` refuses sizes outside them. A dim the program specializes is refused, naming the assumption.
`None`, `Dim.STATIC`, `Dim.AUTO` (which allows specializing) and integers export the example's size.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (
    ConstantArgument,
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)

from ..capture.arguments import check_call, check_callable
from ..capture.held_inputs import held_by_inputs
from ..capture.program import capture_program
from ..capture.result import Capture
from ..errors import ExportError, message
from ..regions.auto import auto_regions
from ..sources import Source
from ..torch_internals import DimHint as _DimHint
from ..torch_internals import DimHintType as _DimHintType
from ..torch_internals import FakeTensorMode, pytree
from ..trace.frames import user_location
from ..trace.names import identifier, root_module
from ..trace.structure import build, flatten_inputs, positional_names
from .aoti import enable_aoti_regions
from .kept_state import kept_state
from .lowering import invokes, lower, mode_switches_as_hops

log = logging.getLogger(__name__)

_CONSTANT = (int, float, bool, str, type(None))
_PREFIX = {InputKind.PARAMETER: "p_", InputKind.BUFFER: "b_", InputKind.CONSTANT_TENSOR: "c_"}


def export_program(fn: Callable, args: tuple, kwargs: dict, dynamic_shapes: Any = None,
                   regions: str | None = None) -> ExportedProgram:
    """`stampout.export` (api.py): check the call, capture it (nothing runs for real), lower it."""
    where = user_location()
    check_callable(fn, "export")
    check_call(fn, args, kwargs, "export")
    if regions not in (None, "auto"):
        raise ExportError(message(f"regions must be None or 'auto', got {regions!r}", where,
                                  "pass regions='auto' to mark repeated children of ModuleLists and Sequentials"))
    ranges = _dynamic_dims(fn, args, kwargs, dynamic_shapes, where)
    leaves = flatten_inputs(args, kwargs)[0]
    automatic = {i: set(ranges[id(leaf)]) for i, leaf in enumerate(leaves) if id(leaf) in ranges}
    root = root_module(fn)
    labels = flatten_inputs(args, kwargs)[2]
    with (auto_regions(root) if regions == "auto" and root is not None else contextlib.nullcontext(),
          kept_state(fn, list(held_by_inputs(leaves, labels)))):  # the model as it was: export runs nothing for real
        cap = capture_program(fn, args, kwargs, automatic=automatic, ranges=ranges, real=False)
    if cap.shapes is not None:
        _check_dims_stayed_dynamic(cap, leaves, ranges, where)
    enable_aoti_regions()
    return export_capture(cap, fn, args, kwargs, where)


# ----------------------------------------------------------------------------------------- dynamic shapes


def _dynamic_dims(fn: Callable, args: tuple, kwargs: dict, dynamic_shapes: Any,
                  where: str) -> dict[int, dict[int, tuple[int, Any, str]]]:
    """Per input tensor (by id), the dims to export symbolic, each with its (min, max, name): `Dim("t", min=,
    max=)`, `Dim.DYNAMIC` and `torch._dynamo.mark_dynamic`. `None`, `Dim.STATIC`, `Dim.AUTO` (which allows
    specializing) and ints keep the example's size."""
    from ..torch_internals import sympy_numbers as numbers

    out: dict[int, dict[int, tuple[int, Any, str]]] = {}
    for label, value in _labelled_leaves(fn, args, kwargs):
        if isinstance(value, torch.Tensor):
            for dim in sorted(getattr(value, "_dynamo_dynamic_indices", None) or ()):
                out.setdefault(id(value), {})[dim] = (0, numbers.int_oo, f"{label}.size({dim})")
    if hasattr(dynamic_shapes, "dynamic_shapes"):  # ShapesCollection, AdditionalInputs
        dynamic_shapes = dynamic_shapes.dynamic_shapes(fn, args, kwargs)
    for label, tensor, dim, spec in _dim_specs(fn, args, kwargs, dynamic_shapes, where):
        if spec is None or (isinstance(spec, _DimHint) and spec.type is not _DimHintType.DYNAMIC):
            continue
        size = tensor.shape[dim]
        if type(spec) is int:
            if spec != size:
                raise ExportError(message(f"dynamic_shapes gives dim {dim} of {label} the size {spec}, the example "
                                          f"has {size}", where, "make the example agree with dynamic_shapes"))
            continue
        low, high = getattr(spec, "min", None), getattr(spec, "max", None)  # (a DimHint's may be None)
        low, high = 0 if low is None else low, numbers.int_oo if high is None else high
        if low == high == size:
            continue
        if not low <= size <= high:
            raise ExportError(message(
                f"dynamic_shapes gives dim {dim} of {label} the range [{low}, {high}]; the example's size is {size}",
                where, "pass an example inside the range",
            ))
        name = getattr(spec, "__name__", f"{label}.size({dim})")
        out.setdefault(id(tensor), {})[dim] = (low, high, name)
    return out


def _check_dims_stayed_dynamic(cap: Capture, leaves: list[Any], ranges: dict, where: str) -> None:
    """A dim asked to be dynamic that the program specialized (its size decided a branch, a view needed that
    size exactly) cannot be exported dynamic: say which, as torch.export does."""
    by_leaf = dict(zip(cap.input_tensor_leaves, cap.fake_inputs()))
    for i, leaf in enumerate(leaves):
        for dim, (_, _, name) in ranges.get(id(leaf), {}).items():
            fake = by_leaf.get(i)
            size = fake.shape[dim] if fake is not None else None
            if size is None:
                continue
            if not isinstance(size, torch.SymInt) or size.node.expr.is_number:
                raise ExportError(message(
                    f"{name} was asked to be dynamic, but the program specializes it to {int(size)}: it requires "
                    f"that size ({cap.shapes.describe()})",
                    where, "export that dim static (Dim.STATIC or Dim.AUTO), or remove what needs the exact size",
                ))


def _dim_specs(fn: Callable, args: tuple, kwargs: dict, dynamic_shapes: Any,
               where: str) -> Iterator[tuple[str, torch.Tensor, int, Any]]:
    """(label, tensor, dim, spec) for each dimension `dynamic_shapes` says something about."""
    bound = _bound_arguments(fn, args, kwargs)
    if dynamic_shapes is None:
        return
    if isinstance(dynamic_shapes, dict):
        _check_keys(dynamic_shapes, fn, bound, where)
        stack = [(name, bound.get(name), spec) for name, spec in dynamic_shapes.items()]
    elif isinstance(dynamic_shapes, (tuple, list)):
        stack = [(name, value, spec) for (name, value), spec in zip(bound.items(), dynamic_shapes)]
    else:
        raise ExportError(message(f"dynamic_shapes is a {type(dynamic_shapes).__name__}", where,
                                  "pass a dict, tuple or list, as torch.export.export takes it"))
    while stack:
        label, value, spec = stack.pop()
        if spec is None:
            continue
        if isinstance(value, torch.Tensor):
            for dim, dim_spec in spec.items() if isinstance(spec, dict) else enumerate(spec):
                yield label, value, dim, dim_spec
        elif isinstance(value, dict) and isinstance(spec, dict):
            stack.extend((f"{label}[{k!r}]", value.get(k), s) for k, s in spec.items())
        elif isinstance(value, (tuple, list)) and isinstance(spec, (tuple, list)):
            stack.extend((f"{label}[{i}]", v, s) for i, (v, s) in enumerate(zip(value, spec)))


def _check_keys(dynamic_shapes: dict, fn: Callable, bound: dict[str, Any], where: str) -> None:
    """Each key of a `dynamic_shapes` dict names an argument of `fn` (torch.export refuses others too)."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        names = [n for n in inspect.signature(target).parameters if n != "self"]
    except (TypeError, ValueError):
        names = []
    names = list(dict.fromkeys([*names, *bound]))
    unknown = [key for key in dynamic_shapes if key not in names]
    if unknown:
        raise ExportError(message(
            f"dynamic_shapes names {', '.join(map(repr, unknown))}, which {'is' if len(unknown) == 1 else 'are'} not "
            f"an argument of {getattr(target, '__qualname__', target)}; its arguments: {', '.join(names)}",
            where, "key dynamic_shapes by the argument names (or pass a tuple in argument order)",
        ))


def _bound_arguments(fn: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        return dict(inspect.signature(target).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return {**{f"args_{i}": a for i, a in enumerate(args)}, **kwargs}


def _labelled_leaves(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """Each pytree leaf of `(args, kwargs)` with the label a user knows it by: `x`, `batch[0]`, `mask`."""
    names = list(positional_names(fn.forward if isinstance(fn, torch.nn.Module) else fn))
    if isinstance(fn, torch.nn.Module) or inspect.ismethod(fn):
        names = names[1:]
    out = []
    for (head, key, *rest), leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        first = (names[key.idx] if key.idx < len(names) else f"args_{key.idx}") if head.idx == 0 else str(key.key)
        out.append((first + pytree.keystr(tuple(rest)), leaf))
    return out


# ------------------------------------------------------------------------------------------ the program


@dataclass
class _Input:
    """One placeholder of the exported graph: its signature entry, its value, the `cap.gm` input it feeds."""

    name: str
    spec: InputSpec
    value: Any
    capture_index: int | None


def export_capture(cap: Capture, fn: Callable, args: tuple, kwargs: dict, where: str | None = None) -> ExportedProgram:
    """The `ExportedProgram` of an existing capture of `fn(*args, **kwargs)` (see `export`)."""
    # torch's export passes import sympy and more: loaded here, so `import stampout` does not pay for them
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from ..torch_internals import ConstantAttrMap, TrainingIRVerifier, lift_constants_pass

    where = where or user_location()
    root = root_module(fn)
    states = _state_inputs(cap, root, args, kwargs)
    users, in_spec = _user_inputs(cap, fn, args, kwargs, where)
    inputs = states + users
    captured = cap.fake_inputs()
    if cap.shapes is not None:  # symbolic: the capture's own fakes and ShapeEnv, so the sizes stay symbols
        fake_mode = cap.shapes.symbols.fake_mode
        fakes = [captured[i.capture_index] if i.capture_index is not None
                 else fake_mode.from_tensor(i.value, static_shapes=True) if isinstance(i.value, torch.Tensor)
                 else i.value for i in inputs]
    else:
        fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
        fakes = [fake_mode.from_tensor(i.value, static_shapes=True) if isinstance(i.value, torch.Tensor)
                 else i.value for i in inputs]
    feeds = sorted((i.capture_index, k) for k, i in enumerate(inputs) if i.capture_index is not None)
    if [index for index, _ in feeds] != list(range(len(cap.gm.graph.find_nodes(op="placeholder")))):
        raise ExportError(message("the captured graph's inputs do not match the call's tensors", where,
                                  "report this as a stampout bug, with the structure of the inputs"))
    gm = lower(cap.gm, [k for _, k in feeds], [i.name for i in inputs], fakes, fake_mode)
    for item, node in zip(inputs, gm.graph.find_nodes(op="placeholder")):
        item.spec.arg.name = node.name
    out_specs, out_spec = _outputs(cap, gm, where)
    signature = ExportGraphSignature([i.spec for i in inputs], out_specs)
    constants: dict[str, Any] = {i.spec.target: i.value for i in states
                                 if i.spec.kind is InputKind.CONSTANT_TENSOR or i.spec.persistent is False}
    for node in gm.graph.find_nodes(op="get_attr"):
        node.meta.setdefault("nn_module_stack", {})  # constants made inside the graph are lifted under the root
    with fake_mode:
        constants.update(lift_constants_pass(gm, signature, ConstantAttrMap()))
    gm, signature = mode_switches_as_hops(gm, signature)
    gm.recompile()
    names = list(_bound_arguments(fn, args, kwargs))
    call_graph = [ModuleCallEntry("", ModuleCallSignature([], [], in_spec, out_spec, forward_arg_names=names))]
    ep = ExportedProgram(
        root=gm, graph=gm.graph, graph_signature=signature,
        state_dict=root.state_dict(keep_vars=True) if root is not None else {},
        range_constraints=_range_constraints(cap, fakes),
        module_call_graph=call_graph, example_inputs=(args, kwargs), constants=constants,
        verifiers=[TrainingIRVerifier],
    )
    log.info("exported %s: %d nodes, %d region calls over %d subgraphs", getattr(fn, "__qualname__", type(fn).__name__),
             len(gm.graph.nodes), len(invokes(gm)), len(dict(gm.named_children())))
    return ep


def _range_constraints(cap: Capture, fakes: list[Any]) -> dict:
    """Each symbol of the inputs' sizes with the range the capture allows (what `ep.module()` checks)."""
    if cap.shapes is None:
        return {}
    env = cap.shapes.symbols.shape_env
    symbols: set = set()
    for fake in fakes:
        if isinstance(fake, torch.Tensor):
            for size in (*fake.shape, *fake.stride(), fake.storage_offset()):
                if isinstance(size, torch.SymInt):
                    symbols |= size.node.expr.free_symbols
    return {s: env.var_to_range[s] for s in sorted(symbols, key=str) if s in env.var_to_range}


def _state_inputs(cap: Capture, root: torch.nn.Module | None, args: tuple, kwargs: dict) -> list[_Input]:
    """`cap.gm`'s lifted placeholders as torch.export lays them out: parameters, then buffers (each in the
    module's order), then constant tensors."""
    params: dict[int, str] = {}
    buffers: dict[int, tuple[str, bool]] = {}
    for prefix, module in root.named_modules(remove_duplicate=False) if root is not None else ():
        dot = f"{prefix}." if prefix else ""
        for key, p in module._parameters.items():
            params.setdefault(id(p), dot + key)
        for key, b in module._buffers.items():
            buffers.setdefault(id(b), (dot + key, key not in module._non_persistent_buffers_set))
    order = {name: k for k, name in enumerate([*params.values(), *(name for name, _ in buffers.values())])}
    first = len(cap.input_tensor_leaves)
    found_inputs: list[_Input] = []
    seen: set[str] = set()
    lifted = cap.placeholders_for(args, kwargs)[first:]
    for i, ((_, found), value) in enumerate(zip(cap.lifted, lifted)):
        persistent = None
        if id(value) in params:
            kind, target = InputKind.PARAMETER, params[id(value)]
        elif id(value) in buffers:
            kind, (target, persistent) = InputKind.BUFFER, buffers[id(value)]
        else:  # a plain tensor attribute, a global, a closure cell
            kind, target = InputKind.CONSTANT_TENSOR, _constant_target(found, i)
        name = _fresh(_PREFIX[kind] + identifier(target, "arg"), seen)
        spec = InputSpec(kind, TensorArgument(name), target, persistent)
        found_inputs.append(_Input(name, spec, value, first + i))
    kinds = list(_PREFIX)
    return sorted(found_inputs, key=lambda i: (kinds.index(i.spec.kind), order.get(i.spec.target, len(order))))


def _constant_target(found: Source | None, index: int) -> str:
    """A state-dict-like name for a lifted tensor from where it was found (`self.cache.k` -> `cache.k`)."""
    if found is None:
        return f"lifted_tensor_{index}"
    name = found.name()
    return name[len("self."):] if name.startswith("self.") else name


def _user_inputs(cap: Capture, fn: Callable, args: tuple, kwargs: dict,
                 where: str) -> tuple[list[_Input], pytree.TreeSpec]:
    """One placeholder per pytree leaf of `(args, kwargs)`, as torch.export lays them out."""
    flat = flatten_inputs(args, kwargs)[0]
    feeds = {id(flat[leaf]): k for k, leaf in enumerate(cap.input_tensor_leaves)}
    seen: set[str] = set()
    out = []
    for label, leaf in _labelled_leaves(fn, args, kwargs):
        name = _fresh(identifier(label, "arg"), seen)
        if isinstance(leaf, torch.Tensor):
            feed = feeds.pop(id(leaf), None)  # an aliased input feeds the capture once
            out.append(_Input(name, InputSpec(InputKind.USER_INPUT, TensorArgument(name), None), leaf, feed))
        elif isinstance(leaf, _CONSTANT):
            out.append(_Input(name, InputSpec(InputKind.USER_INPUT, ConstantArgument(name, leaf), None), leaf, None))
        else:
            raise ExportError(message(
                f"input {label} is a {type(leaf).__name__}; an exported program takes tensors and int/float/bool/"
                "str constants, in tuples, lists, dicts or types registered with torch.utils._pytree",
                where, "pass its tensors instead, or register its type with torch.utils._pytree",
            ))
    return out, pytree.tree_flatten((args, kwargs))[1]


def _outputs(cap: Capture, gm: fx.GraphModule, where: str) -> tuple[list[OutputSpec], pytree.TreeSpec]:
    """Rewrite the output node in torch.export's layout: one entry per pytree leaf of the program's result."""
    output = gm.graph.find_nodes(op="output")[0]
    holes = list(output.args[0])
    leaves, out_spec = pytree.tree_flatten(build(cap.output_template, [_Hole(k) for k in range(len(holes))]))
    values: list[Any] = []
    specs = []
    for leaf in leaves:
        if isinstance(leaf, _Hole):
            values.append(holes[leaf.index])
            specs.append(OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(values[-1].name), None))
        elif isinstance(leaf, _CONSTANT):
            values.append(leaf)
            specs.append(OutputSpec(OutputKind.USER_OUTPUT, ConstantArgument("", leaf), None))
        else:
            raise ExportError(message(
                f"the program returns a {type(leaf).__name__}, which an exported program cannot return", where,
                "return tensors and constants (in tuples, lists, dicts or pytree-registered types)",
            ))
    output.args = (tuple(values),)
    return specs, out_spec


@dataclass
class _Hole:
    """A pytree leaf standing for the program's output tensor number `index`."""

    index: int


def _fresh(name: str, seen: set[str]) -> str:
    candidate, k = name, 1
    while candidate in seen:
        candidate, k = f"{name}_{k}", k + 1
    seen.add(candidate)
    return candidate


__all__ = ["ExportError", "export_capture", "export_program"]
