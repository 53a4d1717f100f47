"""`export`: a captured program as a `torch.export.ExportedProgram` that keeps its regions.

Non-strict torch.export inlines every `invoke_subgraph` it meets, and strict export runs Dynamo over every
layer again. stampout already holds the program as a torch-level FX graph whose region calls share subgraph
modules, so the exported program is built from that graph (lowered to ATen by `lowering.py`) and given what
torch.export gives its own: placeholders in its order and naming (`p_layers_0_mlp_up_proj_weight`) with
state-dict names as targets, a graph signature, lifted constants, input and output specs. The program saves,
loads and runs without stampout; `aoti.py` lets AOTInductor compile each of its regions once.

Shapes are static: the capture bakes sizes read in Python (views, aranges, `x.shape[1]` arithmetic) into
the graph, so a symbolic `Dim` could silently be wrong and is refused; `None`, `Dim.STATIC`, `Dim.AUTO`
(which allows specializing) and integers export the example's shapes.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import Dim, ExportedProgram
from torch.export.dynamic_shapes import _DimHint, _DimHintType
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

from .aoti import enable_aoti_regions
from .api import capture
from .capture import Capture
from .errors import ExportError, message
from .frames import user_location
from .lowering import invokes, lower, mode_switches_as_hops
from .names import root_module
from .sources import Source
from .structure import build, flatten_inputs, positional_names

log = logging.getLogger(__name__)

_CONSTANT = (int, float, bool, str, type(None))
_PREFIX = {InputKind.PARAMETER: "p_", InputKind.BUFFER: "b_", InputKind.CONSTANT_TENSOR: "c_"}


def export(fn: Callable, *args: Any, dynamic_shapes: Any = None, **kwargs: Any) -> ExportedProgram:
    """Capture `fn(*args, **kwargs)` and return it as a `torch.export.ExportedProgram`, regions kept.

    Example::

        ep = stampout.export(model, ids)     # 32 decoder layers whose forward is a stampout.region
        print(len(ep.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)))
        # 32
        print([name for name, _ in ep.graph_module.named_children()])
        # ['repeated_subgraph0']
        torch.export.save(ep, "model.pt2")   # loads and runs in a process that never imports stampout

    Args:
        fn: an `nn.Module` (its parameters and buffers are exported under their state-dict names), a bound
            method of one, or a function (the tensors it reaches become constants of the program).
        *args, **kwargs: example inputs, as for `torch.export.export`.
        dynamic_shapes: as for `torch.export.export`; only static specs are accepted (see the module doc).

    Returns:
        An `ExportedProgram` in torch.export's pre-dispatch IR; each region call is an `invoke_subgraph` over
        a subgraph shared by its equivalent calls. In this process `torch._inductor.aoti_compile_and_package`
        compiles each distinct region once (`stampout.aoti`).

    Raises:
        ExportError: a dimension marked dynamic (`Dim("b")`, `Dim.DYNAMIC`, `mark_dynamic`), an input or
            output that is neither a tensor nor a constant, or an operation that does not lower to ATen.
        CaptureError: the program cannot be captured (see `stampout.capture`).
    """
    where = user_location()
    _check_static(fn, args, kwargs, dynamic_shapes, where)
    cap = capture(fn, *args, **kwargs)
    enable_aoti_regions()
    return export_capture(cap, fn, args, kwargs, where)


# ----------------------------------------------------------------------------------------- dynamic shapes


def _check_static(fn: Callable, args: tuple, kwargs: dict, dynamic_shapes: Any, where: str) -> None:
    """Refuse every dimension the caller asked to be dynamic (see the module doc)."""
    for label, value in _labelled_leaves(fn, args, kwargs):
        if isinstance(value, torch.Tensor) and getattr(value, "_dynamo_dynamic_indices", None):
            dims = sorted(value._dynamo_dynamic_indices)
            raise _dynamic_error(f"{label} is marked with torch._dynamo.mark_dynamic on dims {dims}", where)
    if hasattr(dynamic_shapes, "dynamic_shapes"):  # ShapesCollection, AdditionalInputs
        dynamic_shapes = dynamic_shapes.dynamic_shapes(fn, args, kwargs)
    for label, tensor, dim, spec in _dim_specs(fn, args, kwargs, dynamic_shapes, where):
        if spec is None or (isinstance(spec, _DimHint) and spec.type is not _DimHintType.DYNAMIC):
            continue
        size = tensor.shape[dim]
        static = isinstance(spec, Dim) and getattr(spec, "min", None) == getattr(spec, "max", None) == size
        if static or (type(spec) is int and spec == size):
            continue
        if type(spec) is int:
            raise ExportError(message(f"dynamic_shapes gives dim {dim} of {label} the size {spec}, the example "
                                      f"has {size}", where, "make the example agree with dynamic_shapes"))
        raise _dynamic_error(f"dynamic_shapes marks dim {dim} of {label} as {spec!r}", where)


def _dynamic_error(what: str, where: str) -> ExportError:
    return ExportError(message(
        f"{what}, but stampout.export makes static programs only: the capture bakes sizes read in Python "
        "(views, aranges, arithmetic on x.shape) into the graph, so a symbolic size could silently be wrong",
        where,
        "export with static shapes (None, Dim.STATIC or Dim.AUTO) once per shape, or use torch.export.export",
    ))


def _dim_specs(fn: Callable, args: tuple, kwargs: dict, dynamic_shapes: Any,
               where: str) -> Iterator[tuple[str, torch.Tensor, int, Any]]:
    """(label, tensor, dim, spec) for each dimension `dynamic_shapes` says something about."""
    bound = _bound_arguments(fn, args, kwargs)
    if dynamic_shapes is None:
        return
    if isinstance(dynamic_shapes, dict):
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
    from torch._export.passes.lift_constants_pass import ConstantAttrMap, lift_constants_pass
    from torch._export.verifier import TrainingIRVerifier
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    where = where or user_location()
    root = root_module(fn)
    states = _state_inputs(cap, root, args, kwargs)
    users, in_spec = _user_inputs(cap, fn, args, kwargs, where)
    inputs = states + users
    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fakes = [fake_mode.from_tensor(i.value, static_shapes=True) if isinstance(i.value, torch.Tensor) else i.value
             for i in inputs]
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
        state_dict=root.state_dict(keep_vars=True) if root is not None else {}, range_constraints={},
        module_call_graph=call_graph, example_inputs=(args, kwargs), constants=constants,
        verifiers=[TrainingIRVerifier],
    )
    log.info("exported %s: %d nodes, %d region calls over %d subgraphs", getattr(fn, "__qualname__", type(fn).__name__),
             len(gm.graph.nodes), len(invokes(gm)), len(dict(gm.named_children())))
    return ep


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
        name = _fresh(_PREFIX[kind] + _identifier(target), seen)
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
        name = _fresh(_identifier(label), seen)
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
    slots = list(output.args[0])
    leaves, out_spec = pytree.tree_flatten(build(cap.output_template, [_Slot(k) for k in range(len(slots))]))
    values: list[Any] = []
    specs = []
    for leaf in leaves:
        if isinstance(leaf, _Slot):
            values.append(slots[leaf.index])
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
class _Slot:
    """A pytree leaf standing for the program's output tensor number `index`."""

    index: int


def _identifier(text: str) -> str:
    name = re.sub(r"\W", "_", text).strip("_") or "arg"
    return f"_{name}" if name[0].isdigit() else name


def _fresh(name: str, seen: set[str]) -> str:
    candidate, k = name, 1
    while candidate in seen:
        candidate, k = f"{name}_{k}", k + 1
    seen.add(candidate)
    return candidate


__all__ = ["ExportError", "export", "export_capture"]
