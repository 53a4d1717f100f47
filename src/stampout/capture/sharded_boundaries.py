"""`stampout.capture` of FSDP2 models: each sharded module's call is two boundary nodes around its forward.

# Note: FSDP's hooks in one captured graph
A module sharded with `fully_shard` all-gathers its parameters in a forward pre-hook (and wraps its inputs in
an autograd function whose backward reduce-scatters their gradients) and reshards them in a forward hook
(registering tensor hooks on its outputs that all-gather again before backward). Those need real tensors and
real process groups, so they are not traced. Where the captured program calls a sharded module, the graph gets

    pre = stampout.capture.sharded_boundaries.fsdp_pre_forward(_const_0, h)  # its pre-hooks, eagerly: FSDP's all-gather
    h_1 = pre[0]; n1_weight = pre[1]; ...                           # the hooked inputs, the unsharded parameters
    out = invoke_subgraph(subgraph_0, "subgraph_0", h_1, n1_weight, ...)   # its forward, a region
    post = stampout.capture.sharded_boundaries.fsdp_post_forward(_const_0, h_1, out[0])  # forward hooks: the reshard

The unsharded parameters exist only between the two nodes, so they are outputs of the first (read from the
module per call, after FSDP registered them) rather than placeholders of the graph; gradients flow into them
as in eager and FSDP's own post-backward reduces them into the sharded `.grad`s. While capturing, stampout
unshards each module for real (`FSDPModule.unshard()`, the same all-gathers on every rank, in program order) so
its forward reads real unsharded parameters, and reshards it after. The forward of a module with no sharded
module below it is a region keyed by its code, so a stack of sharded blocks is one trace, stamped out for the
others; a module with sharded modules below it (the root) has its forward traced inline, its children's calls
boundaries of their own. Running the graph runs the hooks as `nn.Module.__call__` would (global hooks first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..context import current, listeners
from ..errors import CaptureError, StampoutError, message
from ..torch_internals import (
    DisableTorchFunction,
    fsdp_cast_dtypes,
    fsdp_lazy_init,
    global_forward_hooks,
    global_forward_hooks_with_kwargs,
    global_forward_pre_hooks,
    pytree,
    unset_fake_temporarily,
)
from ..trace.frames import python_hooks_off, user_location
from ..trace.names import identifier
from .sharded import forward_of, fsdp_module_class, region_forward


@dataclasses.dataclass(eq=False)
class Boundary:
    """One call of a sharded module in a captured graph: what its two nodes need when the graph runs."""

    module: nn.Module
    path: str  # from the captured module, for messages
    params: tuple[str, ...]  # the parameters its forward may read (unsharded during the call), relative to it
    inputs: pytree.TreeSpec  # the structure of (args, kwargs)
    constants: tuple  # the non-tensor leaves of (args, kwargs), None where a tensor is
    output: pytree.TreeSpec | None = None

    def __repr__(self) -> str:
        return f"Boundary({self.path or type(self.module).__name__})"

    def rebuild(self, tensors: tuple) -> tuple[tuple, dict]:
        it = iter(tensors)
        leaves = [next(it) if c is _TENSOR else c for c in self.constants]
        return pytree.tree_unflatten(leaves, self.inputs)

    def tensors_of(self, value: Any, spec: pytree.TreeSpec, what: str) -> list[torch.Tensor]:
        leaves, got = pytree.tree_flatten(value)
        if got != spec:
            raise StampoutError(message(
                f"the hooks of the sharded module {self!r} changed the structure of its {what}: captured {spec}, "
                f"got {got}", user_location(), "capture again (stampout.capture) or use stampout.compile",
            ))
        return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


_TENSOR = object()  # the place of a tensor among a Boundary's constants


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype FSDP's mixed-precision cast (`.to(dtype)` of floating-point tensors only) gives `t`."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def fsdp_pre_forward(boundary: Boundary, *tensors: torch.Tensor) -> tuple:
    """The module's forward pre-hooks on the call's inputs (FSDP's all-gather), then its unsharded parameters."""
    module = boundary.module
    args, kwargs = boundary.rebuild(tensors)
    hooks = global_forward_pre_hooks
    for hook_id, hook in (*hooks.items(), *module._forward_pre_hooks.items()):
        if hook_id in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    inputs = boundary.tensors_of((args, kwargs), boundary.inputs, "inputs")
    return (*inputs, *(module.get_parameter(name) for name in boundary.params))


def fsdp_post_forward(boundary: Boundary, *values: torch.Tensor) -> tuple:
    """The module's forward hooks on its output (FSDP's reshard and pre-backward registrations)."""
    module = boundary.module
    n = sum(c is _TENSOR for c in boundary.constants)
    args, kwargs = boundary.rebuild(values[:n])
    result = pytree.tree_unflatten(list(values[n:]), boundary.output)
    hooks = global_forward_hooks
    with_kwargs = global_forward_hooks_with_kwargs
    for hook_id, hook in (*hooks.items(), *module._forward_hooks.items()):
        if hook_id in module._forward_hooks_with_kwargs or hook_id in with_kwargs:
            out = hook(module, args, kwargs, result)
        else:
            out = hook(module, args, result)
        if out is not None:
            result = out
    return tuple(boundary.tensors_of(result, boundary.output, "output"))


def sharded_modules(fn: Any) -> dict[int, tuple[str, nn.Module]]:
    """The modules sharded with fully_shard that a call of `fn` (a module, or a method of one) may call."""
    from ..trace.names import module_tree, root_module

    cls = fsdp_module_class()
    root = root_module(fn)
    if cls is None or root is None or not any(isinstance(m, cls) for m in module_tree(root)):  # (the common case:
        return {}  # none sharded, found without naming every module)
    return {id(m): (name, m) for name, m in root.named_modules() if isinstance(m, cls)}


def own_parameters(module: nn.Module) -> tuple[str, ...]:
    """The parameters of `module` and of the submodules not sharded on their own (FSDP gathers those)."""
    cls = fsdp_module_class()
    names: list[str] = []
    seen: set[int] = set()

    def walk(m: nn.Module, prefix: str) -> None:
        for name, p in m._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                names.append(prefix + name)
        for name, child in m._modules.items():
            if child is not None and not isinstance(child, cls):
                walk(child, f"{prefix}{name}.")

    walk(module, "")
    return tuple(names)


@contextlib.contextmanager
def _real() -> Iterator[None]:
    """Real tensors and collectives in the middle of a capture: no modes, no listeners, no trace hooks."""
    with python_hooks_off(), DisableTorchFunction(), unset_fake_temporarily(), listeners(None, None):
        yield


class Boundaries:
    """During one capture: calls of sharded modules become boundary nodes (see the module's Note)."""

    def __init__(self, fn: Any, redirect: Callable[[dict[int, Callable], Callable, tuple, dict], Any]) -> None:
        """`redirect(table, fn, args, kwargs)` runs `fn` with each module call whose id is in `table` sent to its
        handler (piecewise compile's machinery, compile/'s: api.capture hands it in)."""
        self.redirect = redirect
        self.modules = sharded_modules(fn)
        self.table: dict[int, Callable] = {}
        for key, (path, module) in self.modules.items():
            self.table[key] = self._handler(module, path)
        first = next(iter(self.modules.values()), None)
        if first is not None:
            with _real():
                fsdp_lazy_init(first[1])  # (what the first forward's root pre-hook does)

    def run(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        return self.redirect(self.table, fn, args, kwargs)

    def _handler(self, module: nn.Module, path: str) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            return self.call(module, path, args, kwargs)

        return call

    def call(self, module: nn.Module, path: str, args: tuple, kwargs: dict) -> Any:
        ctx = current()
        if ctx is None:  # (not capturing on this thread: the module's own call)
            return nn.Module.__call__(module, *args, **kwargs)
        tracer = ctx.tracer
        builder = tracer.builder
        if builder.parent is not None:
            raise CaptureError(message(
                f"the sharded module {path or type(module).__name__} is called inside a region: a reused trace would "
                "run the hooks of the module it was traced with", user_location(),
                "remove the region marker around it (each sharded module's forward is a region already), or use "
                "stampout.compile",
            ))
        with python_hooks_off():
            with _real():
                module.unshard()
            try:
                return self._bounded(tracer, module, path, args, kwargs)
            finally:
                with _real():
                    module.reshard()

    def _bounded(self, tracer: Any, module: nn.Module, path: str, args: tuple, kwargs: dict) -> Any:
        builder = tracer.builder
        graph = builder.graph
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        boundary = Boundary(module, path, own_parameters(module), spec,
                            tuple(_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves))
        const = builder.constant(boundary)
        with DisableTorchFunction():
            params = [module.get_parameter(name) for name in boundary.params]
            pre = graph.call_function(fsdp_pre_forward, (const, *(builder.node_for(t) for t in tensors)))
            cast_in, cast_out = fsdp_cast_dtypes(module)  # (mixed precision: what its hooks cast to)
            hooked = [self._output(tracer, builder, pre, i, t, fresh=True, dtype=_cast(t, cast_in))
                      for i, t in enumerate(tensors)]
            prefix = f"{path}." if path else ""
            for k, (name, p) in enumerate(zip(boundary.params, params)):
                self._output(tracer, builder, pre, len(tensors) + k, p, fresh=False, name=prefix + name)
            it = iter(hooked)
            new_args, new_kwargs = pytree.tree_unflatten(
                [next(it) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
        below = any(isinstance(m, fsdp_module_class()) for m in module.modules() if m is not module)
        body = forward_of(module) if below else region_forward(module)  # (the root's children: boundaries of their own)
        try:
            out = self.run(body, new_args, new_kwargs)
        finally:
            for p in params:
                builder.nodes.pop(id(p), None)
        with DisableTorchFunction():
            out_leaves, boundary.output = pytree.tree_flatten(out)
            if not all(isinstance(leaf, torch.Tensor) for leaf in out_leaves):
                raise CaptureError(message(
                    f"the sharded module {path or type(module).__name__} returns {type(out).__name__} holding values "
                    "other than tensors: stampout.capture keeps only tensor outputs at a sharded module's boundary",
                    user_location(), "return tensors (or tuples of them), or use stampout.compile",
                ))
            post = graph.call_function(fsdp_post_forward, (const, *(builder.node_for(t) for t in hooked),
                                                           *(builder.node_for(t) for t in out_leaves)))
            results = [self._output(tracer, builder, post, i, t, fresh=True, dtype=_cast(t, cast_out))
                       for i, t in enumerate(out_leaves)]
        return pytree.tree_unflatten(results, boundary.output)

    @staticmethod
    def _output(tracer: Any, builder: Any, node: Any, i: int, like: torch.Tensor, fresh: bool,
                name: str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The i-th output of a boundary node: a new fake with `like`'s metadata but `dtype` (`fresh`), or `like`
        itself (an unsharded parameter, its node named after it)."""
        item = builder.graph.create_node("call_function", operator.getitem, (node, i),
                                         name=identifier(name) if name else None)
        if fresh:
            value = tracer.new_fake(tuple(like.shape), like.stride(), like.storage_offset(), dtype or like.dtype,
                                    like.device, like.requires_grad)
            if value.requires_grad:
                tracer.meta.adopt(value)
        else:
            value = like
        item.meta["val"] = tracer.meta_fake(value) if not fresh else value
        builder.bind(value, item)
        return value
