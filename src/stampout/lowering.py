"""Lowering a captured graph to torch.export's IR: pre-dispatch ATen, regions kept as invoke_subgraph.

The captured graph is replayed node by node under `make_fx(pre_dispatch=True)` inside a `TracingContext`,
whose invoke_subgraph cache traces each distinct subgraph once and keeps every call of it as an
`invoke_subgraph` node over the shared subgraph. The replay runs through an `fx.Interpreter`, so every ATen
node keeps the user's stack trace and a failure names the user's line.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode

from .errors import ExportError, StampoutError, message
from .torch_internals import INVOKE_SUBGRAPH

_CUSTOM_FUNCTION_CALL = torch.ops.higher_order.custom_function_call



def lower(source: fx.GraphModule, feeds: list[int], names: list[str], fakes: list[Any],
          fake_mode: FakeTensorMode) -> fx.GraphModule:
    """`source` retraced to pre-dispatch ATen. The result's placeholders are `names`, with `fakes` as values
    (constants included); `source`'s placeholder i is fed by the result's placeholder `feeds[i]`."""
    from torch._export.utils import _compiling_state_context
    from torch.fx.experimental.proxy_tensor import make_fx

    tensors = [k for k, f in enumerate(fakes) if isinstance(f, torch.Tensor)]
    wrappers: dict[int, _Subgraph] = {}

    def program(*values: torch.Tensor) -> tuple:
        by_position = dict(zip(tensors, values))
        return tuple(_Interpreter(source, wrappers).run(*[by_position[k] for k in feeds]))

    grad = torch.is_grad_enabled()
    # Gradients off while tracing: with them on, torch re-derives a region's schema at every call (~0.2 s a
    # layer) to refuse in-place writes; the ops recorded are the same, and that check runs once per region below.
    # Exporting flags on, as torch.export sets them: vmap's level and batch-dim calls are then recorded.
    with (fake_mode, tracing(TracingContext(fake_mode)), fx.traceback.preserve_node_meta(), torch.no_grad(),
          _compiling_state_context(), _vmap_levels_restored()):
        gm = make_fx(program, pre_dispatch=True)(*[fakes[k] for k in tensors])
    for module in gm.modules():  # calls kept for their effect (vmap's levels) carry no value: say so
        for node in module.graph.nodes if isinstance(module, fx.GraphModule) else ():
            if node.op == "call_function":
                node.meta.setdefault("val", None)
    gm.graph._codegen = fx.graph.CodeGen()  # positional placeholders, named below
    _place_inputs(gm, names, fakes, tensors)
    if grad:
        _check_region_writes(gm, fake_mode)
    gm.graph.eliminate_dead_code(lambda n: n.op != "call_function" or n.target is not torch.ops.aten.detach.default)
    gm.graph.lint()
    _name_subgraph_inputs(gm, source)
    return gm


def mode_switches_as_hops(gm: fx.GraphModule, signature: Any) -> tuple[fx.GraphModule, Any]:
    """Grad-mode and autocast sections as torch.export makes them (wrap_with_set_grad_enabled, ...)."""
    from torch._export.passes.replace_autocast_with_hop_pass import replace_autocast_with_hop_pass
    from torch._export.passes.replace_set_grad_with_hop_pass import replace_set_grad_with_hop_pass

    if not _has_mode_switches(gm):
        return gm, signature
    gm, signature = replace_set_grad_with_hop_pass(gm, signature)
    gm, signature = replace_autocast_with_hop_pass(gm, signature)
    _one_name_per_subgraph(gm)
    return gm, signature


def _has_mode_switches(gm: fx.GraphModule) -> bool:
    switches = (torch._C._set_grad_enabled, torch.amp.autocast_mode._enter_autocast)
    return any(module.graph.find_nodes(op="call_function", target=target)
               for module in gm.modules() if isinstance(module, fx.GraphModule) for target in switches)


def _one_name_per_subgraph(gm: fx.GraphModule) -> None:
    """The passes above can register a region's subgraph under a second name; Inductor lowers a subgraph once per
    name, so every call is pointed back at the first one."""
    for module in [m for m in gm.modules() if isinstance(m, fx.GraphModule)]:
        first: dict[int, str] = {}
        for name, child in module._modules.items():
            first.setdefault(id(child), name)
        for node in module.graph.find_nodes(op="get_attr"):
            if isinstance(module._modules.get(node.target), fx.GraphModule):
                node.target = first[id(module._modules[node.target])]
        used = {node.target for node in module.graph.find_nodes(op="get_attr")}
        for name in [n for n, child in module._modules.items() if n not in used and first[id(child)] != n]:
            delattr(module, name)
        module.recompile()


@contextlib.contextmanager
def _vmap_levels_restored() -> Iterator[None]:
    """The graph replays vmap's level changes (`_vmap_increment_nesting`); a failure between them must not
    leave the process inside a vmap."""
    start = torch._C._functorch.maybe_current_level()
    try:
        yield
    finally:
        while torch._C._functorch.maybe_current_level() not in (start, None):
            torch._C._functorch._vmap_decrement_nesting()


def _check_region_writes(gm: fx.GraphModule, fake_mode: FakeTensorMode) -> None:
    """Refuse, once per distinct region, what torch refuses at every call with gradients on: a region that
    writes its inputs (BatchNorm's running stats) cannot be differentiated as an invoke_subgraph on torch 2.13."""
    needs_grad = {n for n in gm.graph.find_nodes(op="placeholder") if getattr(n.meta["val"], "requires_grad", False)}
    checked: set[str] = set()
    for node in gm.graph.nodes:
        if any(arg in needs_grad for arg in node.all_input_nodes):  # conservative: ignores no_grad sections
            needs_grad.add(node)
        if node.target is not INVOKE_SUBGRAPH or node.args[0].target in checked or node not in needs_grad:
            continue
        name, operands = node.args[0].target, [a.meta.get("val") for a in node.args[2:]]
        checked.add(name)
        with fake_mode:
            schema = INVOKE_SUBGRAPH.gen_schema(getattr(gm, name), node.args[1], *operands)
        if any(arg.is_write for arg in schema.arguments):
            raise ExportError(message(
                f"region call {node.name} (subgraph {node.args[1]}) writes its inputs in place, which torch 2.13's "
                "invoke_subgraph cannot differentiate", _location(node),
                "export in eval mode or under torch.no_grad() (the program is then for inference), or leave the "
                "module that updates buffers (BatchNorm in training) out of the region",
            ))


def _place_inputs(gm: fx.GraphModule, names: list[str], fakes: list[Any], tensors: list[int]) -> None:
    """Name the placeholders after their inputs, with their fakes (`requires_grad` kept) as values; add
    placeholders for constant user inputs."""
    by_position = dict(zip(tensors, gm.graph.find_nodes(op="placeholder")))
    previous: fx.Node | None = None
    for k, name in enumerate(names):
        node = by_position.get(k)
        if node is None:
            with gm.graph.inserting_before(previous.next if previous is not None else next(iter(gm.graph.nodes))):
                node = gm.graph.placeholder(name)
        node.meta["val"] = fakes[k]
        node._rename(name)  # the graph may pick another name (`input` is a builtin): the caller reads it back
        node.target = node.name
        previous = node


def _name_subgraph_inputs(gm: fx.GraphModule, source: fx.GraphModule) -> None:
    """Give each lowered region subgraph the placeholder names of the captured one (`hidden`, `self_mlp_...`)."""
    for node in invokes(gm):
        lowered, captured = getattr(gm, node.args[0].target), getattr(source, node.args[1], None)
        if not isinstance(captured, fx.GraphModule):
            continue
        names = [n.name for n in captured.graph.find_nodes(op="placeholder")]
        placeholders = lowered.graph.find_nodes(op="placeholder")
        if len(names) == len(placeholders) and [p.name for p in placeholders] != names:
            for placeholder, name in zip(placeholders, names):
                placeholder._rename(name)
                placeholder.target = placeholder.name
            lowered.recompile()
            _name_subgraph_inputs(lowered, captured)


class _Interpreter(fx.Interpreter):
    """Runs a captured graph node by node, so each ATen node keeps the user's stack trace and a failure to
    lower names the user's line. Subgraphs run through it too, one wrapper per subgraph."""

    def __init__(self, gm: fx.GraphModule, wrappers: dict[int, _Subgraph]) -> None:
        super().__init__(gm)
        self.wrappers = wrappers
        self.extra_traceback = False  # the error names the user's line itself

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        if isinstance(value, fx.GraphModule):
            return self.wrappers.setdefault(id(value), _Subgraph(value, self.wrappers))
        return value

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target is _CUSTOM_FUNCTION_CALL:  # an autograd.Function under vmap: its forward, as capture records them
            return args[0].forward(*args[1:], **kwargs)
        return super().call_function(target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        try:
            return super().run_node(n)
        except StampoutError:
            raise
        except Exception as e:
            raise _lowering_error(n, e) from e


class _Subgraph:
    """A region's subgraph, run through `_Interpreter` when invoke_subgraph traces it."""

    def __init__(self, gm: fx.GraphModule, wrappers: dict[int, _Subgraph]) -> None:
        self.gm, self.wrappers = gm, wrappers

    def __call__(self, *args: Any) -> Any:
        return _Interpreter(self.gm, self.wrappers).run(*args)


def _lowering_error(node: fx.Node, error: Exception) -> ExportError:
    what = (f"region call {node.name} (subgraph {node.args[1]})" if node.target is INVOKE_SUBGRAPH
            else getattr(node.target, "__name__", str(node.target)))
    text = str(error).splitlines()[0] if str(error) else ""
    return ExportError(message(f"cannot export {what}: {type(error).__name__}: {text}", _location(node),
                               "rewrite this operation, or keep it out of the exported program"))


def _location(node: fx.Node) -> str | None:
    """`file:line in function` from a node's stack trace (the tracer's and the region call's formats)."""
    trace = node.meta.get("stack_trace") or ""
    found = (re.findall(r'File "([^"]+)", line (\d+), in (\S+)', trace)
             or re.findall(r"File (\S+):(\d+) in (\S+)", trace))
    return f"{found[-1][0]}:{found[-1][1]} in {found[-1][2]}" if found else None


def invokes(gm: fx.GraphModule) -> list[fx.Node]:
    return gm.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH)
