"""Recording a torch call as FX nodes: the call's node and its outputs' getitems, the tensors lifted as placeholders,
gradient-hook registrations, and a custom autograd.Function's `apply` (run on fakes, recorded as one call).

`Recording` is a part of `Tracer` (tracer.py); `FakeRuns` (fakes.py) computes the values it records.
"""

from __future__ import annotations

import builtins
import operator
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from ..context import current
from ..errors import CaptureError, message
from ..sources import Source
from ..torch_internals import (
    DisableTorchFunction,
    FakeTensor,
    disabled_torch_function_impl,
    is_traceable_wrapper_subclass,
)
from .builder import Builder, has_tensor, map_tensors, node_target
from .caught_kernel_errors import check_not_caught
from .code import is_user_file
from .frames import user_frame, user_location
from .memory import CapturedMemory
from .names import identifier
from .op_facts import may_fail_on_values
from .shapes import Lifted
from .structure import holds_traced_tensor

if TYPE_CHECKING:
    from .region_hooks import RegionHooks
    from .shapes import Symbols

_T = torch.Tensor
# Autograd registrations on a tensor: graph nodes (see Tracer._record_hook).
_HOOK_REGISTRATIONS = {_T.register_hook: "register_hook",
                       _T.register_post_accumulate_grad_hook: "register_post_accumulate_grad_hook"}


def has_own_torch_function(t: torch.Tensor) -> bool:
    """Whether `t`'s class handles torch calls in Python (`__torch_function__`; torch.Tensor's own re-wraps results
    in the subclass): not a Parameter's (disabled) nor a traceable wrapper subclass's (DTensor: traced by torch)."""
    handler = getattr(type(t), "__torch_function__", None)
    return handler is not disabled_torch_function_impl and not is_traceable_wrapper_subclass(t)


def _function_apply(cls: type) -> Callable:
    """A stable graph target for `cls.apply` (a classmethod makes a new bound method on each access), kept
    on the class itself so it lives exactly as long as the class."""
    target = cls.__dict__.get("__stampout_apply__")
    if target is None:
        def apply(*args: Any, **kwargs: Any) -> Any:
            return cls.apply(*args, **kwargs)

        apply.__name__ = f"{cls.__name__}_apply"
        apply.__qualname__ = f"{cls.__qualname__}.apply"
        backward = getattr(getattr(cls, "backward", None), "__code__", None)  # (the user's Python runs in backward:
        # what it reads at run time, AOTAutograd would read once while it traces; see backends.python_backwards)
        apply.__stampout_python_backward__ = backward is not None and is_user_file(backward.co_filename)
        target = apply
        type.__setattr__(cls, "__stampout_apply__", apply)
    return target


def refuse_shared_memory(memory: CapturedMemory, t: torch.Tensor, name: Any) -> None:
    """A capture cannot read two tensors in distinct storages over the same memory: their fakes would be apart.
    `name`: what the message calls `t`, a string or a Source (spelled out only for the message: a stamped layer
    lifts ten parameters, each with a path of six steps)."""
    other = memory.claim(t, name)
    if other is not None:
        raise CaptureError(message(
            f"{other} and {name} share memory through two different storages (torch.from_numpy or frombuffer of "
            "the same array, say): the captured graph would take them as apart", user_location(),
            "make one a view of the other (t[...], t.view(...)) or pass a copy (.clone())"))


class Recording:
    """Torch calls and lifted tensors as nodes of the graph being built (a part of `Tracer`, which sets the
    attributes below)."""

    names: Any  # .find(real tensor) -> (placeholder name, source from the root) | None
    builder: Builder  # (Tracer.builder: the innermost graph being built)
    regions: RegionHooks | None
    symbols: Symbols | None
    dynamic_tensors: dict[int, tuple[torch.Tensor, tuple[int, ...], str]]
    lifted: list[tuple[fx.Node, torch.Tensor, Source | None]]
    memory: CapturedMemory
    fake_of: Callable[[torch.Tensor], torch.Tensor]  # (FakeRuns.fake_of)
    meta_fake: Callable[[torch.Tensor], FakeTensor]  # (FakeRuns.meta_fake)

    def lift(self, builder: Builder, t: torch.Tensor) -> fx.Node:
        """Make `t` a placeholder of `builder` (and of every parent it has to pass through)."""
        if builder.parent is not None:
            return self.regions.lift_into_subgraph(builder, t)
        if isinstance(t, FakeTensor):
            raise CaptureError(message(
                f"a tensor of shape {tuple(t.shape)} made by no torch call the capture sees reached the graph (made "
                "over a Python object's memory: torch.from_numpy, torch.frombuffer?)", user_location(),
                "make that tensor outside the captured code (a buffer, an argument), or use stampout.compile, which "
                "runs such code eagerly; if it is none of these, report it as a stampout bug, with the model",
            ))
        found = self.names.find(t)
        if type(t) is not torch.Tensor and has_own_torch_function(t):
            raise CaptureError(message(
                f"the program uses {found[1].name() if found and found[1] is not None else 'a tensor'} of shape "
                f"{tuple(t.shape)}, a {type(t).__qualname__}: a torch.Tensor subclass whose __torch_function__ "
                "stampout's graph would bypass (its overrides and the class of its results)", user_location(),
                "stampout.compile runs such a module eagerly; hold a plain tensor (t.as_subclass(torch.Tensor)) "
                "to capture it"))
        name = found[0] if found is not None else f"lifted_tensor_{len(self.lifted)}"
        refuse_shared_memory(self.memory, t, found[1] if found and found[1] is not None else name)
        if self.regions is not None:
            self.regions.note_root_lift(t)
        # A stamped region lifts many parameters: their placeholders' meta['val'] is filled when `gm` is
        # first used (fill_meta), which keeps capture at a few FX nodes per stamped layer.
        node = builder.placeholder(identifier(name), t, meta=False)
        position = len(self.lifted)
        self.lifted.append((node, t, found[1] if found is not None else None))
        if id(t) in self.dynamic_tensors:
            fake = node.meta["val"] = self.fake_of(t)
            self.symbols.bind_input(Lifted(position), fake, node)
        return node

    def fill_meta(self) -> None:
        """Give every placeholder still without one a `meta['val']` fake (after capture, on first use)."""
        for node, t, _ in self.lifted:
            if "val" not in node.meta:
                node.meta["val"] = self.meta_fake(t)

    def _record_hook(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """`t.register_hook(fn)` (and post-accumulate-grad hooks): a graph node, so every run of the graph
        registers `fn` on its real tensor, as eager does; the traces it is part of are not reused (their
        stamped calls would register the first call's function)."""
        tensor, *rest = args
        hook = rest[0] if rest else next(iter(kwargs.values()))
        where = user_location(3)
        if holds_traced_tensor(hook):
            raise CaptureError(message(
                f"a gradient hook ({_HOOK_REGISTRATIONS[func]}) closes over a tensor the captured program computed",
                where, "register the hook outside the captured function, or make it use only its gradient argument "
                "and tensors held by the module",
            ))
        if self.regions is not None:
            self.regions.note_unkept(f"registers a gradient hook ({_HOOK_REGISTRATIONS[func]}) at {where}")
        out = func(self.fake_of(tensor), hook)
        builder = self.builder
        node = builder.graph.call_method(_HOOK_REGISTRATIONS[func], (builder.node_for(tensor), builder.literal(hook)))
        node.meta["stack_trace"] = f"  File {where}\n"
        return out

    def on_autograd_function(self, cls: type, apply: Callable, args: tuple, kwargs: dict) -> Any:
        """`cls.apply(*args)` of a custom autograd.Function: its forward runs on fakes for the output
        metadata (not recorded), and the graph calls `cls.apply` itself, so its backward is the user's."""
        if not (has_tensor(args) or has_tensor(kwargs)):
            return apply(cls, *args, **kwargs)
        fake_args = map_tensors(args, self.fake_of)
        fake_kwargs = map_tensors(kwargs, self.fake_of)
        try:
            with DisableTorchFunction():
                out = apply(cls, *fake_args, **fake_kwargs)
        except CaptureError:
            raise
        except (RuntimeError, AssertionError) as error:  # (autograd's checks on the fakes, which are leaves:
            # `mark_dirty` of an input; the fake mode's on a tensor the forward reads without being given it: the
            # parameters of reentrant checkpointing's function)
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise CaptureError(message(
                f"the custom autograd.Function {cls.__qualname__} cannot run on the capture's tensors: {first}",
                user_location(), "pass every tensor its forward uses as an argument (use_reentrant=False for "
                "torch.utils.checkpoint), or use stampout.compile, which runs such a call eagerly")) from error
        self.record(_function_apply(cls), args, kwargs, out)
        return out

    def record(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> fx.Node:
        if may_fail_on_values(func) and (ctx := current()) is not None:  # (see caught_kernel_errors.py)
            check_not_caught(sys._getframe(1), ctx.root, f"the torch call {getattr(func, '__name__', func)}")
        builder = self.builder
        op, target = node_target(func)
        node_args = builder.literal(map_tensors(args, builder.node_for, True))
        node_kwargs = builder.literal(map_tensors(kwargs, builder.node_for, True)) if kwargs else {}
        if op == "call_function" and target is builtins.getattr:
            node_args = (node_args[0], func.__self__.__name__)
        if op == "call_method":
            node = builder.graph.call_method(target, node_args, node_kwargs)
        else:
            node = builder.graph.call_function(target, node_args, node_kwargs)
        self._annotate(node, out)
        self.bind_outputs(builder, node, out)
        return node

    def bind_outputs(self, builder: Builder, node: fx.Node, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            builder.bind(out, node)
        elif isinstance(out, (tuple, list)):
            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    item_node = builder.graph.call_function(operator.getitem, (node, i))
                    item_node.meta["val"] = item
                    builder.bind(item, item_node)
                elif isinstance(item, (tuple, list)) and has_tensor(item):  # (histogramdd: hist, [edges, ...])
                    item_node = builder.graph.call_function(operator.getitem, (node, i))
                    item_node.meta["val"] = item
                    self.bind_outputs(builder, item_node, item)

    def _annotate(self, node: fx.Node, out: Any) -> None:
        node.meta["val"] = out
        frame = user_frame(3)
        if frame is not None:
            code = frame.f_code
            node.meta["stack_trace"] = f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}\n'
