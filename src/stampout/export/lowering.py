"""Lowering a captured graph to torch.export's IR: pre-dispatch ATen, regions kept as invoke_subgraph.

The captured graph is replayed node by node under `make_fx(pre_dispatch=True)` inside a `TracingContext`,
whose invoke_subgraph cache traces each distinct subgraph once and keeps every call of it as an
`invoke_subgraph` node over the shared subgraph. The replay runs through an `fx.Interpreter`, so every ATen
node keeps the user's stack trace and a failure names the user's line.

Per-region work is done once and stamped out per call, as the capture does it. torch's rule for invoke_subgraph
under make_fx runs the whole subgraph on fake tensors at every call to learn outputs the first call already
showed, and snapshots every operand; a later call with the same operand metadata gets its node and fresh output
fakes directly (`_Stamp`). Inputs only handed to regions (each layer's weights) never enter make_fx, whose cost
per input would grow with depth: their placeholders are made directly. Graph modules stay lazy, so their Python
code is generated once, by the `ExportedProgram`, rather than after every edit.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .. import config
from ..errors import ExportError, StampoutError, message
from ..torch_internals import (
    INVOKE_SUBGRAPH,
    DisableTorchFunction,
    FakeTensor,
    FakeTensorMode,
    TracingContext,
    enter_autocast,
    functorch_vmap_decrement_nesting,
    maybe_current_level,
    set_grad_enabled,
    tracing,
)
from ..trace.shapes import has_symbols, size_key, sizes_key

_CUSTOM_FUNCTION_CALL = torch.ops.higher_order.custom_function_call


def lower(source: fx.GraphModule, feeds: list[int], names: list[str], fakes: list[Any],
          fake_mode: FakeTensorMode) -> fx.GraphModule:
    """`source` retraced to pre-dispatch ATen. The result's placeholders are `names`, with `fakes` as values
    (constants included); `source`'s placeholder i is fed by the result's placeholder `feeds[i]`."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

    from ..torch_internals import compiling_state_context as _compiling_state_context
    from ..torch_internals import extract_tensor_metadata as _extract_tensor_metadata
    from ..torch_internals import use_lazy_graph_module as _use_lazy_graph_module

    tensors = [k for k, f in enumerate(fakes) if isinstance(f, torch.Tensor)]
    # Inputs only handed to regions (a layer's weights) stay out of make_fx, which costs ~0.15 ms an input: their
    # placeholders are made directly and region calls that are stamped out take them as they are.
    captured = source.graph.find_nodes(op="placeholder")
    # (a symbolic input stays with make_fx, which must see the symbols its sizes define)
    operands_only = {feeds[i] for i, node in enumerate(captured)
                     if config.stamp_out_lowering and _operand_only(node) and not has_symbols(fakes[feeds[i]])}
    traced = [k for k in tensors if k in feeds and k not in operands_only]
    lowering = _Lowering(fake_mode)
    added: dict[int, fx.Node] = {}

    def program(*values: torch.Tensor) -> tuple:
        by_position = dict(zip(traced, values))
        lowering.top = get_proxy_mode().tracer
        graph = lowering.top.graph
        with DisableTorchFunction():
            for k in sorted(operands_only):
                node = added[k] = graph.placeholder(f"_input_{k}")  # named by _place_inputs
                node.meta["val"] = by_position[k] = fakes[k]
                node.meta["tensor_meta"] = _extract_tensor_metadata(fakes[k])  # as make_fx's placeholders have it
                lowering.untracked[id(fakes[k])] = node
        return tuple(_Interpreter(source, lowering).run(*[by_position[k] for k in feeds]))

    grad = torch.is_grad_enabled()
    # Gradients off while tracing: with them on, torch re-derives a region's schema at every call (~0.2 s a
    # layer) to refuse in-place writes; the ops recorded are the same, and that check runs once per region below.
    # Exporting flags on, as torch.export sets them: vmap's level and batch-dim calls are then recorded.
    with (fake_mode, tracing(TracingContext(fake_mode)), fx.traceback.preserve_node_meta(), torch.no_grad(),
          _compiling_state_context(), _vmap_levels_restored(), _use_lazy_graph_module(True)):
        gm = make_fx(program, pre_dispatch=True)(*[fakes[k] for k in traced])
    for module in gm.modules():  # calls kept for their effect (vmap's levels) carry no value: say so
        for node in module.graph.nodes if isinstance(module, fx.GraphModule) else ():
            if node.op == "call_function":
                node.meta.setdefault("val", None)
    gm.graph._codegen = fx.graph.CodeGen()  # positional placeholders, named below
    mine = set(added.values())
    made = [n for n in gm.graph.find_nodes(op="placeholder") if n not in mine]
    _place_inputs(gm, names, fakes, {**dict(zip(traced, made)), **added})
    if grad:
        _check_region_writes(gm)
    gm.graph.eliminate_dead_code(lambda n: n.op != "call_function" or n.target is not torch.ops.aten.detach.default)
    gm.graph.lint()
    _name_subgraph_inputs(gm, source)
    return gm


def _operand_only(placeholder: fx.Node) -> bool:
    """Whether a captured input is read only as an operand of region calls."""
    return bool(placeholder.users) and all(
        user.target is INVOKE_SUBGRAPH and placeholder not in user.args[:2] and not user.kwargs
        for user in placeholder.users)


def mode_switches_as_hops(gm: fx.GraphModule, signature: Any) -> tuple[fx.GraphModule, Any]:
    """Grad-mode and autocast sections as torch.export makes them (wrap_with_set_grad_enabled, ...)."""
    from ..torch_internals import replace_autocast_with_hop_pass, replace_set_grad_with_hop_pass

    if not _has_mode_switches(gm):
        return gm, signature
    gm, signature = replace_set_grad_with_hop_pass(gm, signature)
    gm, signature = replace_autocast_with_hop_pass(gm, signature)
    _one_name_per_subgraph(gm)
    return gm, signature


def _has_mode_switches(gm: fx.GraphModule) -> bool:
    switches = (set_grad_enabled, enter_autocast)
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
    start = maybe_current_level()
    try:
        yield
    finally:
        while maybe_current_level() not in (start, None):
            functorch_vmap_decrement_nesting()


def _check_region_writes(gm: fx.GraphModule) -> None:
    """Refuse, once per distinct region, what torch refuses at every call with gradients on: a region that
    writes its inputs (BatchNorm's running stats) cannot be differentiated as an invoke_subgraph on torch 2.13.
    The writes are read off the lowered subgraph, as torch's schema check reads them off a fresh trace of it."""
    from ..torch_internals import check_input_alias_and_mutation_return_outputs

    needs_grad = {n for n in gm.graph.find_nodes(op="placeholder") if getattr(n.meta["val"], "requires_grad", False)}
    checked: set[str] = set()
    for node in gm.graph.nodes:
        if any(arg in needs_grad for arg in node.all_input_nodes):  # conservative: ignores no_grad sections
            needs_grad.add(node)
        if node.target is not INVOKE_SUBGRAPH or node.args[0].target in checked or node not in needs_grad:
            continue
        checked.add(node.args[0].target)
        if check_input_alias_and_mutation_return_outputs(getattr(gm, node.args[0].target))[3]:
            raise ExportError(message(
                f"region call {node.name} (subgraph {node.args[1]}) writes its inputs in place, which torch 2.13's "
                "invoke_subgraph cannot differentiate", _location(node),
                "export in eval mode or under torch.no_grad() (the program is then for inference), or leave the "
                "module that updates buffers (BatchNorm in training) out of the region",
            ))


def _place_inputs(gm: fx.GraphModule, names: list[str], fakes: list[Any], by_position: dict[int, fx.Node]) -> None:
    """Put the placeholders in the order of `names`, named after them, with their fakes (`requires_grad` kept) as
    values; add placeholders for the inputs the graph does not read (constants, unused tensors)."""
    previous: fx.Node | None = None
    for k, name in enumerate(names):
        node = by_position.get(k)
        if node is None:
            with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
                node = gm.graph.placeholder(name)
        if previous is None:
            first = next(iter(gm.graph.nodes))
            if first is not node:
                first.prepend(node)
        elif previous.next is not node:
            previous.append(node)
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

    def __init__(self, gm: fx.GraphModule, lowering: _Lowering) -> None:
        super().__init__(gm)
        self.lowering = lowering
        self.extra_traceback = False  # the error names the user's line itself

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        if isinstance(value, fx.GraphModule):
            return self.lowering.wrappers.setdefault(id(value), _Subgraph(value, self.lowering))
        return value

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target is _CUSTOM_FUNCTION_CALL:  # an autograd.Function under vmap: its forward, as capture records them
            return args[0].forward(*args[1:], **kwargs)
        if target is INVOKE_SUBGRAPH and not kwargs:
            return self.lowering.invoke(args, lambda: super(_Interpreter, self).call_function(target, args, kwargs))
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

    def __init__(self, gm: fx.GraphModule, lowering: _Lowering) -> None:
        self.gm, self.lowering = gm, lowering

    def __call__(self, *args: Any) -> Any:
        return _Interpreter(self.gm, self.lowering).run(*args)


@dataclass
class _Stamp:
    """A region call lowered by torch: the metadata of its operands and of its outputs (fresh storages)."""

    operands: tuple
    outputs: list[tuple]


class _Lowering:
    """The state of one `lower`: one wrapper per captured subgraph, one stamp per lowered region identifier, the
    placeholders of inputs make_fx does not track (by the id of their fake)."""

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        self.fake_mode = fake_mode
        self.wrappers: dict[int, _Subgraph] = {}
        self.stamps: dict[str, _Stamp | None] = {}
        self.untracked: dict[int, fx.Node] = {}
        self.top: Any = None  # the tracer of the program, whose graph holds the untracked placeholders

    def invoke(self, args: tuple, lower_call: Callable[[], Any]) -> Any:
        """A region call in the lowered graph: stamped out when an earlier call with the same operand metadata
        showed its outputs, else lowered by torch (which traces the subgraph on the identifier's first call)."""
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        from ..torch_internals import get_invoke_subgraph_cache

        identifier, operands = args[1], args[2:]
        if not config.stamp_out_lowering:
            return lower_call()
        cache = get_invoke_subgraph_cache()
        graph = cache.get_proxy_dispatch_entry(identifier) if cache is not None else None
        mode = get_proxy_mode()
        with DisableTorchFunction():  # metadata reads and fake outputs, not calls make_fx should see
            key = tuple(_operand_key(t) for t in operands)
            stamp = self.stamps.get(identifier)
            if stamp is not None and stamp.operands == key and isinstance(graph, fx.GraphModule) and mode is not None:
                return self._stamp_out(mode.tracer, graph, identifier, operands, stamp)
        if mode is not None:
            self._track(mode.tracer, operands)
        out = lower_call()
        with DisableTorchFunction():
            if identifier not in self.stamps:  # judged on the first call: None keeps every call on torch's rule
                self.stamps[identifier] = (_Stamp(key, [(o.shape, o.stride(), o.dtype, o.device) for o in out])
                                           if _stampable(key, operands, out) else None)
        return out

    def _track(self, tracer: Any, operands: tuple) -> None:
        """Let make_fx see the untracked operands of a call torch lowers, as its placeholders."""
        from torch.fx.experimental.proxy_tensor import get_proxy_slot, track_tensor_tree

        for t in operands:
            node = self.untracked.get(id(t))
            if node is not None and get_proxy_slot(t, tracer, None) is None:
                track_tensor_tree(t, fx.Proxy(node, tracer), constant=None, tracer=tracer)

    def _stamp_out(self, tracer: Any, graph: fx.GraphModule, identifier: str, operands: tuple,
                   stamp: _Stamp) -> tuple:
        """The node torch's proxy-mode rule for invoke_subgraph records for a cached identifier, made directly:
        outputs from the stamp (not by running the subgraph again on fake tensors), operands as the nodes that
        hold them, their values as the node's `eager_input_vals`."""
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_slot, track_tensor_tree

        qualname = next((name for name, m in tracer.root.named_modules() if m is graph), None)
        if qualname is None:  # a nested region's first stamped call at this level
            qualname = tracer.get_fresh_qualname("repeated_subgraph")
            tracer.root.register_module(qualname, graph)
        nodes: list[Any] = []
        for t in operands:
            if isinstance(t, torch.SymInt):  # a bound symbol: the node make_fx computes it with
                slot = get_proxy_slot(t, tracer, None)
                nodes.append(slot.force().node if slot is not None else t)
                continue
            if not isinstance(t, torch.Tensor):
                nodes.append(t)
                continue
            slot = get_proxy_slot(t, tracer, None)
            node = slot.proxy.node if slot is not None else self.untracked.get(id(t)) if tracer is self.top else None
            if node is None:
                raise ExportError(f"stampout bug: an operand of region call {identifier} is not in the graph")
            nodes.append(node)
        attr = fx.Tracer.create_node(tracer, "get_attr", qualname, (), {})
        call = fx.Tracer.create_node(tracer, "call_function", INVOKE_SUBGRAPH, (attr, identifier, *nodes), {})
        call.meta["eager_input_vals"] = ((None, None, *[n.meta.get("val") if isinstance(n, fx.Node) else None
                                                        for n in nodes]), {})
        with disable_proxy_modes_tracing(), self.fake_mode:
            out = tuple(torch.empty_strided(shape, stride, dtype=dtype, device=device)
                        for shape, stride, dtype, device in stamp.outputs)
        return track_tensor_tree(out, fx.Proxy(call, tracer), constant=None, tracer=tracer)


def _stampable(key: tuple, operands: tuple, out: Any) -> bool:
    """Outputs a stamp can remake: a tuple of fake tensors without grad, each the sole owner of a storage of its
    own size (no alias of an operand, of another output, or of a larger buffer)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    if any(k is None for k in key) or not isinstance(out, tuple):
        return False
    if not all(type(o) is FakeTensor and o.layout is torch.strided and not o.requires_grad and o.storage_offset() == 0
               and o.untyped_storage().nbytes() == o.numel() * o.element_size() for o in out):
        return False
    storages = [StorageWeakRef(t.untyped_storage()) for t in (*operands, *out) if isinstance(t, torch.Tensor)]
    return len(set(storages)) == len(storages)


def _operand_key(value: Any) -> tuple | None:
    """An invoke_subgraph operand's metadata (None: one a stamp does not handle)."""
    if type(value) is FakeTensor:  # (symbolic sizes by expression: the same symbols, the same stamp)
        return (sizes_key(value.shape), sizes_key(value.stride()), size_key(value.storage_offset()), value.dtype,
                value.device, value.requires_grad, value.layout)
    if isinstance(value, torch.SymInt):  # a bound symbol
        return (torch.SymInt, size_key(value))
    if value is None or type(value) in (int, float, bool, str):
        return (type(value), value)
    return None


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
