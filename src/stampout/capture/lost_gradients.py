"""Why stampout cannot keep the gradients of a program: autograd registrations a call makes behind the tensors'
backs (module backward hooks, FSDP2's post-backward reduce-scatter), which a captured graph would lose.
"""

from __future__ import annotations

from typing import Any

import torch


def autograd_refusal(fn: Any, own_hooks_outside: bool = False, sharded_boundaries: bool = False,
                     modules: list[Any] | None = None) -> str | None:
    """Why stampout cannot keep the autograd registrations a call of `fn` makes behind the tensors' backs, or
    None: module backward hooks (torch registers them on the autograd nodes of the call's own tensors) and
    FSDP2's post-backward reduce-scatter (registered on the unsharded parameters each call makes). With
    `own_hooks_outside`, the program is the root module's forward, its own hooks run eagerly around it
    (sharded.py): only the modules below it count. With `sharded_boundaries`, sharded modules' hooks are nodes of
    the graph (capture/sharded_boundaries.py). `modules`: the root's `modules()`, where listed already."""
    from ..trace.names import root_module
    from .sharded import fsdp_module_class

    root = root_module(fn)
    if root is None or not torch.is_grad_enabled():
        return None
    fsdp_module = fsdp_module_class()
    from torch.nn.modules import module as nn_module

    if nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks:
        return "a global module backward hook is registered (register_module_full_backward_hook)"
    for m in root.modules() if modules is None else modules:  # (names only for the message: a deep model has
        if own_hooks_outside and m is root:  # thousands of modules)
            continue
        if fsdp_module is not None and isinstance(m, fsdp_module) and not sharded_boundaries:
            return (f"{_label(root, m)} is sharded with fully_shard (FSDP2): its hooks all-gather its parameters and "
                    "reduce their gradients, so they run eagerly around its own compiled forward")
        d = m.__dict__
        if d.get("_backward_hooks") or d.get("_backward_pre_hooks"):
            return f"{_label(root, m)} has a module backward hook (register_full_backward_hook / _pre_hook)"
    return None


def _label(root: torch.nn.Module, module: torch.nn.Module) -> str:
    """`Root.path.to.module` (the root's class alone for the root)."""
    name = next((name for name, m in root.named_modules() if m is module), "")
    return f"{type(root).__name__}.{name}" if name else type(root).__name__


def updated_with_history(gm: torch.fx.GraphModule, inputs: list[Any], names: list[str]) -> str | None:
    """The name of a graph input the graph updates in place that has autograd history of its own (a buffer an
    earlier call accumulated a grad-requiring value into: `self.acc.add_(y)`), or None. Through AOTAutograd such an
    input's update joins the compiled backward to the history: the next backward runs through the earlier call's
    freed graph (eager's does not). `inputs`: the real tensors per placeholder; `names`: how a user reads them."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value, name in zip(placeholders, inputs, names):
        fake = node.meta.get("val")
        if (isinstance(value, torch.Tensor) and value.grad_fn is not None and isinstance(fake, torch.Tensor)
                and not fake.is_inference() and fake._version > 0):
            return name
    return None
