"""Running a torch call on fake tensors: the fakes of values, shape propagation (the meta fast path, FakeTensorMode,
symbolic sizes) and the data-dependent paths (an op on constant tensors is evaluated, any other is refused).

`FakeRuns` is a part of `Tracer` (tracer.py): it computes what a call returns; `Recording` (recording.py) puts the
call into the graph. It knows nothing of regions beyond the `RegionHooks` the tracer holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CaptureError, message
from ..torch_internals import (
    DataDependentOutputException,
    DisableTorchFunction,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    is_functorch_wrapped_tensor,
    is_traceable_wrapper_subclass,
    unset_fake_temporarily,
)
from .builder import Builder, has_tensor, map_tensors
from .constants import ConstantValues
from .frames import user_location, user_source_line
from .kernels import Specializer, is_symbolic_limit
from .meta import MetaRunner, meta_like
from .names import identifier
from .op_errors import op_failed
from .op_facts import writes_in_place
from .shapes import Symbols, symbolic_fake
from .structure import tensors_of

if TYPE_CHECKING:
    from .region_hooks import RegionHooks

log = logging.getLogger(__name__)

_is_wrapped = is_functorch_wrapped_tensor
_FIX_DATA = (
    "keep the decision in the graph: use torch.where(cond, a, b) for values or torch.cond for branches, "
    "or move the check outside the captured function"
)


def _specialize(value: Any) -> Any:
    """A symbolic size's value, guarded; tensors as they are."""
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    return bool(value) if isinstance(value, torch.SymBool) else value


class FakeRuns:
    """What a torch call returns, computed on fakes (a part of `Tracer`, which sets the attributes below)."""

    fake_mode: FakeTensorMode
    root: Builder
    regions: RegionHooks | None
    symbols: Symbols | None
    constants: ConstantValues
    meta: MetaRunner
    # real tensors captured with symbolic dims: id -> (tensor, dims, name)
    dynamic_tensors: dict[int, tuple[torch.Tensor, tuple[int, ...], str]]
    _fakes: dict[int, tuple[torch.Tensor, FakeTensor]]  # id(real tensor) -> (it, its fake)
    record: Callable[..., Any]  # (Recording.record)

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
            fake = self.meta.make_fake(elem, device)
            if requires_grad:
                fake.requires_grad_(True)
        return fake

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

    def _raise_data_dependent(self, what: str) -> None:
        line = user_source_line(3)
        raise CaptureError(message(
            f"data-dependent Python during capture: {what} needs a tensor's value, which is unknown while tracing"
            + (f"\n  code: {line}" if line else ""),
            user_location(3),
            _FIX_DATA,
        ))
