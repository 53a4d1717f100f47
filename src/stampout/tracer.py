"""The capture tracer: FakeTensorMode for values, a TorchFunctionMode that records torch calls as FX nodes.

Python runs for real; every torch-level call reaches `Tracer.on_call`, which runs it on fake tensors and
records a node in the graph being built. A `Builder` is one graph under construction: the outer program,
or the subgraph of a region call being traced (its placeholders are lifted from the parent on demand).
"""

from __future__ import annotations

import builtins
import logging
import operator
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import PreDispatchTorchFunctionMode

from .builder import (
    Builder,
    has_tensor,
    is_op,
    is_property_get,
    is_property_set,
    map_tensors,
    node_target,
)
from .constants import ConstantValues
from .context import current
from .errors import AutogradCallError, CaptureError, message
from .frames import outside_stampout, python_hooks_off, user_frame, user_location, user_source_line
from .kernels import Specializer, is_symbolic_limit
from .meta import NOT_HANDLED, MetaRunner, meta_like
from .names import identifier
from .op_errors import op_failed
from .op_facts import NEEDS_VALUE, VIEW_PROPERTIES, draws_random, writes_in_place
from .regions import slots
from .regions.code import is_user_file
from .regions.purity import saved_hooks_keep_values
from .shapes import Symbols, any_symbolic, symbolic_fake
from .sources import Source
from .structure import tensors_of
from .torch_internals import (
    DataDependentOutputException,
    DisableTorchFunction,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    HigherOrderOperator,
    check_message,
    enter_autocast,
    exit_autocast,
    is_functorch_wrapped_tensor,
    is_traceable_wrapper_subclass,
    lazy_load_decompositions,
    set_grad_enabled,
    top_saved_tensors_default_hooks,
    torch_assert,
    torch_assert_async,
    unset_fake_temporarily,
    vmap_decrement_nesting,
    vmap_increment_nesting,
)
from .world import holds_traced_tensor

log = logging.getLogger(__name__)

_T = torch.Tensor
# Reading these makes a trace depend on which inputs require grad.
# Tensor state that is neither metadata nor value, read by user code (`p.grad is None`, `x._version`): no guard
# sees it change between calls, so a trace that reads it is not reused and a compiled program runs eagerly.
_STATE_GETTERS = {_T.grad.__get__: "grad", _T._version.__get__: "_version"}
_AUTOGRAD_GETTERS = {_T.requires_grad.__get__, _T.is_leaf.__get__, _T.grad_fn.__get__, _T.requires_grad_}
_ENTER_AUTOCAST = enter_autocast
_EXIT_AUTOCAST = exit_autocast
_SET_GRAD = set_grad_enabled
# vmap's nesting bookkeeping: replayed in the graph for its effect, its int result baked in.
_FUNCTORCH_STATE = {
    vmap_increment_nesting,
    vmap_decrement_nesting,
    lazy_load_decompositions,
}
_is_wrapped = is_functorch_wrapped_tensor
# Autograd registrations on a tensor: graph nodes (see Tracer._record_hook).
_HOOK_REGISTRATIONS = {_T.register_hook: "register_hook",
                       _T.register_post_accumulate_grad_hook: "register_post_accumulate_grad_hook"}
_FIX_DATA = (
    "keep the decision in the graph: use torch.where(cond, a, b) for values or torch.cond for branches, "
    "or move the check outside the captured function"
)


def _function_apply(cls: type) -> Callable:
    """A stable graph target for `cls.apply` (a classmethod makes a new bound method on each access), kept
    on the class itself so it lives exactly as long as the class."""
    target = cls.__dict__.get("__stampout_apply__")
    if target is None:
        def apply(*args: Any, **kwargs: Any) -> Any:
            return cls.apply(*args, **kwargs)

        apply.__name__ = f"{cls.__name__}_apply"
        apply.__qualname__ = f"{cls.__qualname__}.apply"
        target = apply
        type.__setattr__(cls, "__stampout_apply__", apply)
    return target


def _specialize(value: Any) -> Any:
    """A symbolic size's value, guarded; tensors as they are."""
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    return bool(value) if isinstance(value, torch.SymBool) else value


class RegionHooks(Protocol):
    """What the tracer asks of the region handler."""

    def lift_into_subgraph(self, builder: Builder, t: torch.Tensor) -> fx.Node: ...

    def note_root_lift(self, t: torch.Tensor) -> None: ...

    def note_autograd_read(self) -> None: ...

    def note_value_decision(self, scope: frozenset[int]) -> None: ...

    def note_hook(self, reason: str) -> None: ...

    def note_unguarded_read(self, reason: str) -> None: ...

    def lift_symbol(self, builder: Builder, symbol: Any) -> fx.Node: ...

    def frame_ids(self) -> frozenset[int]: ...

    def hooks_set(self) -> bool:
        """Whether its trace or profile function is set now (the tracer then calls torch without them)."""
        ...


class CaptureMode(PreDispatchTorchFunctionMode):
    """Sends every torch-level call (autocast enter/exit included) to the tracer."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__(tracer)  # type: ignore[arg-type]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.tracer.on_call(func, args, kwargs or {})


_saved_tensors_hooks = top_saved_tensors_default_hooks


class Tracer:
    """State of one capture: the fake mode, the stack of graphs being built, the names of lifted tensors."""

    def __init__(self, fake_mode: FakeTensorMode, names: Any,
                 higher_order: Callable[[Tracer, Any, tuple, dict], Any] | None = None,
                 regions: Callable[[Tracer], RegionHooks] | None = None) -> None:
        self.fake_mode = fake_mode
        # torch.cond and friends: (tracer, op, args, kwargs) -> result, or NOT_HANDLED (see higher_order.py)
        self.higher_order = higher_order
        self.names = names  # .get(real tensor) -> (placeholder name, source from the root) | None
        self.root = Builder(self)
        self.builders: list[Builder] = [self.root]
        self.lifted: list[tuple[fx.Node, torch.Tensor, Source | None]] = []  # outer lifted real tensors
        self._fakes: dict[int, tuple[torch.Tensor, FakeTensor]] = {}
        self._autocast_nodes: list[fx.Node] = []
        self.constants = ConstantValues(self._frame_ids)
        self.meta = MetaRunner(fake_mode)
        self.mode = CaptureMode(self)
        # the region handler (regions.call.RegionCalls), made for this tracer by `regions`
        self.regions: RegionHooks | None = None
        self.symbols: Symbols | None = None  # a symbolic capture's symbols (see shapes.py)
        # Real tensors reached through input objects whose dims are captured symbolic (a growing KV cache):
        # id -> (tensor, dims, name). Their fakes have symbols and they are lifted as soon as they are made.
        self.dynamic_tensors: dict[int, tuple[torch.Tensor, tuple[int, ...], str]] = {}
        # Saved-tensor hooks the caller set around the capture apply to the graph's autograd when it runs too.
        self.saved_hooks_outside = _saved_tensors_hooks(False) is not None
        # torch's CPU generator state when the program started (capturing.py): a graph's random ops draw from
        # the state at run time, so Python that reseeds it during the program cannot be captured
        self.rng_state: torch.Tensor | None = None
        if regions is not None:
            self.regions = regions(self)

    def _compiling(self) -> bool:
        """A compiled program is being captured: what makes it ineligible runs it eagerly, with a warning."""
        program = getattr(self.regions, "program", None)
        return program is not None and program.abandon

    @property
    def builder(self) -> Builder:
        return self.builders[-1]

    def _frame_ids(self) -> frozenset[int]:
        return self.regions.frame_ids() if self.regions is not None else frozenset()

    # ---- values -------------------------------------------------------------------------------
    def fake_of(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, FakeTensor) or _is_wrapped(t):  # fakes, and vmap's batched fakes
            return t
        hit = self._fakes.get(id(t))
        if hit is not None:
            return hit[1]
        dynamic = self.dynamic_tensors.get(id(t))
        with DisableTorchFunction():
            if dynamic is None:
                fake = self.fake_mode.from_tensor(t, static_shapes=True)
            else:
                fake = symbolic_fake(self.fake_mode, t, identifier(dynamic[2]), dynamic[1])
        self._fakes[id(t)] = (t, fake)
        if dynamic is not None:
            self.root.node_for(t)  # a placeholder of the outer graph now: it defines the symbols
        return fake

    def meta_fake(self, t: torch.Tensor) -> FakeTensor:
        """A fake with `t`'s metadata for a placeholder's `meta['val']`: the memoized one, or a cheap new one
        (`from_tensor` costs ~70 us; a stamped region lifts many parameters that no traced op ever reads)."""
        hit = self._fakes.get(id(t))
        if hit is not None:
            return hit[1]
        if id(t) in self.dynamic_tensors or (type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t)):
            return self.fake_of(t)  # (a DTensor parameter's fake is a DTensor: backends look for subclass inputs)
        with DisableTorchFunction():
            return self.new_fake(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device,
                                 t.requires_grad)

    def new_fake(self, shape: tuple, stride: tuple, offset: int, dtype: torch.dtype, device: torch.device,
                 requires_grad: bool) -> FakeTensor:
        """A fake tensor from known metadata, built with the fake mode unset (~10 us instead of ~170 us)."""
        with unset_fake_temporarily():
            elem = meta_like(shape, stride, offset, dtype)
            fake = FakeTensor(self.fake_mode, elem, device)
            if requires_grad:
                fake.requires_grad_(True)
        return fake

    def lift(self, builder: Builder, t: torch.Tensor) -> fx.Node:
        """Make `t` a placeholder of `builder` (and of every parent it has to pass through)."""
        if builder.parent is not None:
            return self.regions.lift_into_subgraph(builder, t)
        if isinstance(t, FakeTensor):
            raise CaptureError(message(
                f"a fake tensor of shape {tuple(t.shape)} reached the graph without being recorded",
                user_location(), "report this as a stampout bug, with the model",
            ))
        found = self.names.find(t)
        name = found[0] if found is not None else f"lifted_tensor_{len(self.lifted)}"
        if self.regions is not None:
            self.regions.note_root_lift(t)
        # A stamped region lifts many parameters: their placeholders' meta['val'] is filled when `gm` is
        # first used (fill_meta), which keeps capture at a few FX nodes per stamped layer.
        node = builder.placeholder(identifier(name), t, meta=False)
        position = len(self.lifted)
        self.lifted.append((node, t, found[1] if found is not None else None))
        if id(t) in self.dynamic_tensors:
            fake = node.meta["val"] = self.fake_of(t)
            self.symbols.bind_input(("lifted", position), fake, node)
        return node

    def fill_meta(self) -> None:
        """Give every placeholder still without one a `meta['val']` fake (after capture, on first use)."""
        for node, t, _ in self.lifted:
            if "val" not in node.meta:
                node.meta["val"] = self.meta_fake(t)

    # ---- the torch function hook ----------------------------------------------------------------
    def on_call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        # The region handler's trace function shows it the user code that runs; torch's own Python under
        # this call is not user code, and skipping it keeps a trace fast.
        if isinstance(func, HigherOrderOperator) and self.higher_order is not None:
            out = self.higher_order(self, func, args, kwargs)  # its functions run as user code (the hook sees them)
            if out is not NOT_HANDLED:
                return out
        regions = self.regions
        if regions is None or not regions.hooks_set():
            return self._on_call(func, args, kwargs)
        with python_hooks_off():
            return self._on_call(func, args, kwargs)

    def _on_call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        builder = self.builder
        if torch.is_inference_mode_enabled() != (builder._inference[-1][0] if builder._inference
                                                 else builder._inference_base):
            builder.sync_inference(torch.is_inference_mode_enabled())
        context = current()
        if context is not None and context.slots_followed:  # a per-layer index a region follows, passed to torch
            slots.touch(args)
            slots.touch(kwargs)
        what = NEEDS_VALUE.get(func)
        if what is not None:
            if self.constants.knows_all(args, kwargs):
                if self.regions is not None:
                    self.regions.note_value_decision(self.constants.scope_of(args, kwargs))
                return self.constants.evaluate(func, args, kwargs)
            self._raise_data_dependent(what)
        if func is torch_assert and args and isinstance(args[0], torch.Tensor):
            # `torch._assert(tensor, msg)`: a check, not data; the graph asserts it when it runs
            return self._on_call(torch_assert_async, (args[0], check_message(args[1] if len(args) > 1 else None)), {})
        hooks = _saved_tensors_hooks(False)
        if (hooks is not None and not self.saved_hooks_outside and not self._compiling()
                and not saved_hooks_keep_values(hooks[0])):
            raise CaptureError(message(  # (a graph keeps no hooks: backward would save the plain tensors)
                "the program sets torch.autograd.graph.saved_tensors_hooks (or save_on_cpu) around torch calls",
                user_location(), "move the hooks outside the captured call, or use stampout.compile, which runs "
                "such a module eagerly"))
        if func is torch.autograd.grad:  # (on fakes it cannot run: the program's own backward is not traced)
            raise AutogradCallError(message(
                "the program calls torch.autograd.grad (a gradient inside the forward)", user_location(),
                "stampout.compile runs such a module eagerly; call torch.autograd.grad outside the captured code",
            ))
        if func is _SET_GRAD:
            func(*args, **kwargs)
            self.builder.graph.call_function(_SET_GRAD, args)
            return None
        if func is _ENTER_AUTOCAST:
            node = self.builder.graph.call_function(_ENTER_AUTOCAST, args)
            self._autocast_nodes.append(node)
            return None
        if func is _EXIT_AUTOCAST:
            self.builder.graph.call_function(_EXIT_AUTOCAST, (self._autocast_nodes.pop(),))
            return None
        if func in _FUNCTORCH_STATE:
            builder = self.builder
            builder.graph.call_function(func, builder.literal(map_tensors(args, builder.node_for, True)),
                                        builder.literal(map_tensors(kwargs, builder.node_for, True)))
            return func(*args, **kwargs)
        if func is _T.__iter__:  # record the unbind that iteration performs
            return iter(self._on_call(_T.unbind, (args[0], 0), {}))
        if is_property_set(func) and func.__self__.__name__ == "data" and isinstance(args[0], torch.Tensor):
            # `param.data = t` (loading, pruning): replayed by the graph at its place in the order
            builder = self.builder
            target = builder.node_for(args[0])
            value = builder.literal(map_tensors(args[1], builder.node_for))
            builder.graph.call_function(builtins.setattr, (target, func.__self__.__name__, value))
            return None

        if func in _HOOK_REGISTRATIONS:
            return self._record_hook(func, args, kwargs)
        if self.rng_state is not None and draws_random(func) and kwargs.get("generator") is None:
            self._check_rng_untouched(func)
        tensors_in = has_tensor(args) or has_tensor(kwargs)
        if self.symbols is not None and (any_symbolic(args) or any_symbolic(kwargs) or self._dynamic_in(args, kwargs)):
            return self._on_symbolic_call(func, args, kwargs, tensors_in)
        if func in _STATE_GETTERS and self.regions is not None:
            self._note_state_read(_STATE_GETTERS[func])
        if (tensors_in and is_property_get(func) and not isinstance(args[0], FakeTensor)
                and func.__self__.__name__ not in VIEW_PROPERTIES):
            value = func(args[0])  # `param.shape`, `buffer.dtype`: read the real tensor, record nothing
            if not isinstance(value, torch.Tensor):
                return value
        out = self.meta.run(func, args, kwargs) if tensors_in else NOT_HANDLED
        if out is NOT_HANDLED:
            out = self._run_on_fakes(func, args, kwargs, tensors_in)
        else:
            self.constants.after(func, args, kwargs, out, tensors_in)
        if func in _AUTOGRAD_GETTERS and self.regions is not None:
            self.regions.note_autograd_read()
        # (an op that returns nothing is called for its effect: `x.add_(y)` on a tensor, `aten._print` on none)
        if not has_tensor(out) and not (out is None and (tensors_in or is_op(func)) and not is_property_get(func)):
            return out
        self.record(func, args, kwargs, out)
        return out

    def _note_state_read(self, name: str) -> None:
        frame = outside_stampout(3)
        if frame is not None and is_user_file(frame.f_code.co_filename):  # (torch's own Python: its business)
            self.regions.note_unguarded_read(
                f"reads the tensor state .{name}, which no guard sees change between calls "
                f"(at {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name})")

    def _check_rng_untouched(self, func: Callable) -> None:
        """A random op draws from torch's generator at run time, where the program's Python left it during
        capture: `torch.manual_seed` or `fork_rng` in forward set it, and the graph would not."""
        if self._compiling():  # (compile: the profile hook saw the Generator call, the program runs eagerly)
            return
        with DisableTorchFunction(), unset_fake_temporarily():
            same = torch.equal(torch.random.get_rng_state(), self.rng_state)
        if not same:
            raise CaptureError(message(
                f"the program sets torch's random number generator (torch.manual_seed, set_rng_state, fork_rng) "
                f"before a random op ({getattr(func, '__name__', func)}): a graph draws from the generator as "
                "the caller left it, not as the program set it", user_location(),
                "seed outside the captured call, pass a torch.Generator (generator=...) to the random op, or use "
                "stampout.compile, which runs such a program eagerly"))

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
            self.regions.note_hook(f"registers a gradient hook ({_HOOK_REGISTRATIONS[func]}) at {where}")
        out = func(self.fake_of(tensor), hook)
        builder = self.builder
        node = builder.graph.call_method(_HOOK_REGISTRATIONS[func], (builder.node_for(tensor), builder.literal(hook)))
        node.meta["stack_trace"] = f"  File {where}\n"
        return out

    def _dynamic_in(self, args: tuple, kwargs: dict) -> bool:
        """Whether a real tensor captured with symbolic dims is among the arguments (its metadata must come
        from its fake, not from the real tensor)."""
        dynamic = self.dynamic_tensors
        return bool(dynamic) and any(id(t) in dynamic for t in tensors_of((args, kwargs)))

    def _on_symbolic_call(self, func: Callable, args: tuple, kwargs: dict, tensors_in: bool) -> Any:
        """An op with a symbolic size among its arguments (`x.view(b, t, -1)`, `torch.arange(t)`): shape
        propagation on fakes only, and no constant values (its result depends on the size)."""
        if tensors_in:
            fake_args, fake_kwargs = map_tensors(args, self.fake_of), map_tensors(kwargs, self.fake_of)
        else:
            fake_args, fake_kwargs = args, kwargs
        try:
            out = func(*fake_args, **fake_kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            self._raise_data_dependent(f"{getattr(func, '__name__', func)} (its result depends on tensor values)")
        except RuntimeError as error:
            if not is_symbolic_limit(error):
                self._raise_op_failed(func, fake_args, fake_kwargs, error)
            # A kernel without symbolic support (constant_pad_nd's pad widths): the sizes it takes are
            # specialized (guarded) and the op recorded with their values.
            args, kwargs = map_tensors(args, _specialize, True), map_tensors(kwargs, _specialize, True)
            out = self._specialized(func, fake_args, fake_kwargs)
        self.constants.forget_if_mutated(func, args, kwargs)
        if not has_tensor(out) and not (out is None and tensors_in):
            return out
        self.record(func, args, kwargs, out)
        return out

    def on_autograd_function(self, cls: type, apply: Callable, args: tuple, kwargs: dict) -> Any:
        """`cls.apply(*args)` of a custom autograd.Function: its forward runs on fakes for the output
        metadata (not recorded), and the graph calls `cls.apply` itself, so its backward is the user's."""
        if not (has_tensor(args) or has_tensor(kwargs)):
            return apply(cls, *args, **kwargs)
        fake_args = map_tensors(args, self.fake_of)
        fake_kwargs = map_tensors(kwargs, self.fake_of)
        with DisableTorchFunction():
            out = apply(cls, *fake_args, **fake_kwargs)
        self.record(_function_apply(cls), args, kwargs, out)
        return out

    def _run_on_fakes(self, func: Callable, args: tuple, kwargs: dict, tensors_in: bool) -> Any:
        """Shape propagation through FakeTensorMode (what the meta fast path could not do)."""
        if tensors_in:
            fake_args = map_tensors(args, self.fake_of)
            fake_kwargs = map_tensors(kwargs, self.fake_of) if kwargs else kwargs
        else:
            fake_args, fake_kwargs = args, kwargs
        try:
            first = fake_args[0] if fake_args else None
            if tensors_in and self.meta.made(first) and writes_in_place(func, args, kwargs):
                out = self.meta.mutate(func, fake_args, fake_kwargs)
            else:
                out = func(*fake_args, **fake_kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as error:
            return self._from_constants(func, args, kwargs, error)
        except RuntimeError as error:
            if self.symbols is None or not is_symbolic_limit(error):
                self._raise_op_failed(func, fake_args, fake_kwargs, error)
            out = self._specialized(func, fake_args, fake_kwargs)  # nn.LSTM's kernel calls numel()
        self.constants.after(func, args, kwargs, out, tensors_in)
        return out

    @staticmethod
    def _raise_op_failed(func: Callable, fake_args: tuple, fake_kwargs: dict, error: RuntimeError) -> None:
        """A shape bug or a missing fake kernel, said as eager says it, at the user's line (other torch errors
        propagate as they are)."""
        if type(error) is not RuntimeError and type(error).__name__ != "UnsupportedOperatorException":
            raise error
        raise op_failed(func, fake_args, fake_kwargs, error) from error

    def _specialized(self, func: Callable, fake_args: tuple, fake_kwargs: dict) -> Any:
        """`func` on static stand-ins of its symbolic arguments (guarded: the capture holds for these sizes)."""
        log.debug("%s cannot take symbolic sizes: specialized", getattr(func, "__name__", func))
        static = Specializer(self.new_fake)
        return func(*map_tensors(fake_args, static, True), **map_tensors(fake_kwargs, static, True))

    def _from_constants(self, func: Callable, args: tuple, kwargs: dict, error: Exception) -> Any:
        """A data-dependent op on constant tensors: its real result, as fakes (and known values)."""
        name = getattr(func, "__name__", func)
        if not self.constants.knows_all(args, kwargs):
            if isinstance(error, DynamicOutputShapeException):
                self._raise_data_dependent(f"{name} (its output shape depends on tensor values)")
            self._raise_data_dependent(f"{name} (its result depends on tensor values)")
        scope = self.constants.scope_of(args, kwargs)
        if self.regions is not None:
            self.regions.note_value_decision(scope)  # the output's shape came from the values
        real = self.constants.evaluate(func, args, kwargs)
        with DisableTorchFunction():
            out = map_tensors(real, lambda t: self.fake_mode.from_tensor(t, static_shapes=True))
        self.constants.remember(out, real, scope)
        return out

    def record(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> fx.Node:
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

    def _annotate(self, node: fx.Node, out: Any) -> None:
        node.meta["val"] = out
        frame = user_frame(3)
        if frame is not None:
            code = frame.f_code
            node.meta["stack_trace"] = f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}\n'

    def _raise_data_dependent(self, what: str) -> None:
        line = user_source_line(3)
        raise CaptureError(message(
            f"data-dependent Python during capture: {what} needs a tensor's value, which is unknown while tracing"
            + (f"\n  code: {line}" if line else ""),
            user_location(3),
            _FIX_DATA,
        ))
