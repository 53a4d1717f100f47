"""The capture tracer: FakeTensorMode for values, a TorchFunctionMode that records torch calls as FX nodes.

Python runs for real; every torch-level call reaches `Tracer.on_call`, which runs it on fake tensors and
records a node in the graph being built. A `Builder` is one graph under construction: the outer program,
or the subgraph of a region call being traced (its placeholders are lifted from the parent on demand).

`Tracer` is three parts: this file decides what a call is (a value decision, a state change, a refusal, an op);
`FakeRuns` (fakes.py) computes its result on fakes; `Recording` (recording.py) puts it into the graph.
"""

from __future__ import annotations

import builtins
import logging
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import PreDispatchTorchFunctionMode

from ..context import current
from ..errors import AutogradCallError, CaptureError, message
from ..sources import Source
from ..torch_internals import (
    DisableTorchFunction,
    FakeTensor,
    FakeTensorMode,
    HigherOrderOperator,
    check_message,
    enter_autocast,
    exit_autocast,
    lazy_load_decompositions,
    set_grad_enabled,
    top_saved_tensors_default_hooks,
    torch_assert,
    torch_assert_async,
    unset_fake_temporarily,
    vmap_decrement_nesting,
    vmap_increment_nesting,
)
from .builder import (
    Builder,
    has_tensor,
    is_op,
    is_property_get,
    is_property_set,
    map_tensors,
)
from .code import is_user_file
from .constants import ConstantValues
from .fakes import FakeRuns
from .frames import outside_stampout, python_hooks_off, user_location
from .memory import CapturedMemory
from .meta import NOT_HANDLED, MetaRunner
from .op_facts import NEEDS_VALUE, UNGUARDED_READS, VIEW_PROPERTIES, draws_random, saved_hooks_keep_values
from .recording import _HOOK_REGISTRATIONS, Recording
from .region_hooks import RegionHooks
from .shapes import Symbols, any_symbolic

log = logging.getLogger(__name__)

_T = torch.Tensor
_DIFFERENTIATES = types.MappingProxyType({torch.autograd.grad: "torch.autograd.grad", _T.backward: "backward()",
                                          torch.autograd.backward: "torch.autograd.backward"})
# Reading these makes a trace depend on which inputs require grad. (Tensor facts no guard sees: UNGUARDED_READS.)
_AUTOGRAD_GETTERS = {_T.requires_grad.__get__, _T.requires_grad_}
_HANDLE_TORCH_FUNCTION = torch.overrides.handle_torch_function.__code__
_ENTER_AUTOCAST = enter_autocast
_EXIT_AUTOCAST = exit_autocast
_SET_GRAD = set_grad_enabled
# vmap's nesting bookkeeping: replayed in the graph for its effect, its int result baked in.
_FUNCTORCH_STATE = {
    vmap_increment_nesting,
    vmap_decrement_nesting,
    lazy_load_decompositions,
}


def _makes_leaf(func: Callable, args: tuple, kwargs: dict) -> bool:
    """`t.requires_grad_()` / `t.requires_grad = True` on a tensor the program computed or was given: `t` becomes a
    leaf whose .grad eager fills."""
    if func is _T.requires_grad_:
        wanted = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
    elif is_property_set(func) and func.__self__.__name__ == "requires_grad":
        wanted = args[1]
    else:
        return False
    return bool(wanted) and isinstance(args[0], FakeTensor)  # (a traced value or input; the module's real
    # parameters and buffers are the graph's inputs, their requires_grad read per call)


def _from_user_code() -> bool:
    frame = outside_stampout(2)
    return frame is not None and is_user_file(frame.f_code.co_filename)


_WRAPPERS = {torch.nn.Parameter.__new__.__code__: "nn.Parameter", torch.nn.Buffer.__new__.__code__: "nn.Buffer"}


def _wrapped_by_user() -> str | None:
    """`nn.Parameter(t)` / `nn.Buffer(t)` written in the program, on a traced tensor (their Python detaches it): which.
    Eager makes a new leaf (whose .grad it fills) or a tensor a module registers when stored; a graph computes a
    plain tensor."""
    frame = outside_stampout(2)
    name = _WRAPPERS.get(frame.f_code) if frame is not None else None
    return name if name is not None and frame.f_back is not None and is_user_file(frame.f_back.f_code.co_filename) \
        else None


class CaptureMode(PreDispatchTorchFunctionMode):
    """Sends every torch-level call (autocast enter/exit included) to the tracer."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__(tracer)  # type: ignore[arg-type]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.tracer.on_call(func, args, kwargs or {})


_saved_tensors_hooks = top_saved_tensors_default_hooks


class Tracer(FakeRuns, Recording):
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
        self.memory = CapturedMemory()  # the real tensors made fakes (inputs, lifted), by their memory
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
        # torch's CPU generator state when the program started (capture/program.py): a graph's random ops draw from
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
        if context is not None and context.slots_followed and self.regions is not None:  # (a region's per-layer
            self.regions.note_torch_arguments(args, kwargs)  # indices, passed to torch)
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
        if func in _DIFFERENTIATES:  # (on fakes it cannot run: the program's own backward is not traced, and
            # `.backward()` fills the leaves' .grad that the program's Python then reads, an optimizer's step)
            raise AutogradCallError(message(
                f"the program calls {_DIFFERENTIATES[func]} (a gradient inside the forward)", user_location(),
                f"stampout.compile runs such a module eagerly; call {_DIFFERENTIATES[func]} outside the captured code",
            ))
        if (func is _T.retain_grad or _makes_leaf(func, args, kwargs)) and _from_user_code():  # (eager autograd fills
            # that tensor's .grad, a compiled backward does not; a leaf made in forward is often differentiated
            # there: its module's children run eagerly too, see AutogradCallError. torch's own calls, FSDP's, pass)
            raise (CaptureError if func is _T.retain_grad else AutogradCallError)(message(
                f"the program calls {'retain_grad()' if func is _T.retain_grad else 'requires_grad_()'} on a tensor "
                "(its .grad is filled only by eager autograd, not by a captured graph's backward)", user_location(),
                "stampout.compile runs such a module eagerly; capture the gradient with a hook outside the captured "
                "code, or torch.autograd.grad on an output"))
        if func is _T.detach and (made := _wrapped_by_user()) is not None:
            raise AutogradCallError(message(
                f"the program makes an {made} of a tensor it computed (eager makes a new one on each call, which a "
                "module registers when stored and whose .grad eager fills; a captured graph computes a plain tensor)",
                user_location(), f"stampout.compile runs such a module eagerly; make the {made} in __init__"))
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
            # `param.data = t` (loading, pruning): replayed by the graph at its place in the order (a graph
            # AOTAutograd functionalizes drops it: compile runs such a program eagerly)
            if self.regions is not None:
                self.regions.note_unkept(f"sets a tensor's .data (at {user_location()})")
            builder = self.builder
            target = builder.node_for(args[0])
            value = builder.literal(map_tensors(args[1], builder.node_for))
            builder.graph.call_function(builtins.setattr, (target, func.__self__.__name__, value))
            return None

        if func in _HOOK_REGISTRATIONS:
            return self._record_hook(func, args, kwargs)
        if self.rng_state is not None and draws_random(func) and kwargs.get("generator") is None:
            self._check_rng_untouched(func)
        if func in UNGUARDED_READS and self.regions is not None:
            self._note_state_read(func, *UNGUARDED_READS[func])
        tensors_in = has_tensor(args) or has_tensor(kwargs)
        if self.symbols is not None and (any_symbolic(args) or any_symbolic(kwargs) or self._dynamic_in(args, kwargs)):
            return self._on_symbolic_call(func, args, kwargs, tensors_in)
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

    def _note_state_read(self, func: Callable, name: str, unanswered: str) -> None:
        frame = outside_stampout(3)
        while frame is not None and frame.f_code in (_HANDLE_TORCH_FUNCTION, getattr(func, "__code__", None)):
            frame = frame.f_back  # (`Tensor.is_shared` is Python that hands the call to the modes: its caller)
        if frame is not None and is_user_file(frame.f_code.co_filename):  # (torch's own Python: its business)
            where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
            self.regions.note_unguarded_read(
                f"reads the tensor state {name}, which no guard sees change between calls (at {where})")
            if unanswered == "fake" or unanswered == "region" and len(self.builders) > 1:  # (compile: eager above)
                raise CaptureError(message(
                    f"the program reads the tensor state {name}, which a captured graph cannot depend on (traced "
                    "tensors have no memory; a region's inputs are traced as fresh tensors)", where, "use "
                    "stampout.compile, which runs such a program eagerly, or take the decision outside the capture"))

    def _check_rng_untouched(self, func: Callable) -> None:
        """A random op draws from torch's generator at run time, where the program's Python left it during
        capture: `torch.manual_seed` or `fork_rng` in forward set it, and the graph would not. Each random op
        moves the real generator on by one draw (fakes draw nothing), so a state the program saved before it and
        set again after (`st = torch.get_rng_state()`, draw, `torch.set_rng_state(st)`, draw) differs too; the
        capture puts the generator back after."""
        if self._compiling():  # (compile: the profile hook saw the Generator call, the program runs eagerly)
            return
        with DisableTorchFunction(), unset_fake_temporarily():
            same = torch.equal(torch.random.get_rng_state(), self.rng_state)
            torch.empty(1).random_()
            self.rng_state = torch.random.get_rng_state()
        if not same:
            raise CaptureError(message(
                f"the program sets torch's random number generator (torch.manual_seed, set_rng_state, fork_rng) "
                f"before a random op ({getattr(func, '__name__', func)}): a graph draws from the generator as "
                "the caller left it, not as the program set it", user_location(),
                "seed outside the captured call, pass a torch.Generator (generator=...) to the random op, or use "
                "stampout.compile, which runs such a program eagerly"))
