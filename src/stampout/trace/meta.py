"""A fast path for shape propagation: run an op on plain meta tensors instead of fake ones.

FakeTensorMode costs 100-350 us per op (`F.linear` on fakes: ~350 us); the same op on meta tensors plus
wrapping its result as a fake costs ~25 us. The meta path is taken only where it gives the same metadata
as the fake path: every tensor argument a FakeTensor on one device, no autocast, no vmap, no in-place op
(which would change the fake's own metadata), no device moves. Anything the meta kernels cannot do (data-
dependent shapes, missing kernels, a user's shape error) falls back to the fake path, which raises or
answers as before.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from ..torch_internals import (
    FakeMaker,
    FakeTensor,
    FakeTensorMode,
    is_any_autocast_enabled,
    peek_interpreter_stack,
    unset_fake_temporarily,
)
from .constants import const_key, is_constant
from .structure import tensors_of

NOT_HANDLED = object()
_DEVICE_MOVES = frozenset({"cuda", "cpu", "type", "pin_memory", "share_memory_", "new_tensor",
                           "__setitem__", "setitem", "__getstate__", "__reduce_ex__", "__get__"})


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, TypeError):
        return False
    return True


def _name(func: Callable) -> str:
    return getattr(func, "__name__", "") or ""


# Composite ops that choose their kernel by device: on meta tensors they take another kernel than on the
# fakes' device, with other output strides (CPU's flash attention keeps the query's layout, the math kernel
# on meta returns a contiguous result: diffusers' VAE attention, then group_norm's memory format).
_DEVICE_CHOSEN = frozenset({"scaled_dot_product_attention", "cdist", "lstm", "gru", "rnn_tanh", "rnn_relu"})


def _eligible_name(name: str) -> bool:
    if name in _DEVICE_MOVES or name in _DEVICE_CHOSEN:
        return False
    if name.endswith("_") and not name.endswith("__"):
        return False  # in place: the fake's own metadata may change
    return not (name.startswith("__i") and name.endswith("__"))  # __iadd__ and friends


class MetaRunner:
    """Runs ops on meta stand-ins of fake tensors and wraps the results as fakes."""

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        self.fake_mode = fake_mode
        self.make_fake = FakeMaker(fake_mode)  # (FakeTensor's constructor, cheaper)
        self._eligible: dict[Any, bool] = {}
        # Fakes made here carry requires_grad but no autograd history (they are leaves); see mutate().
        self._made: dict[int, FakeTensor] = {}
        self._memo: dict[tuple, Any] = {}  # op + input metadata -> output metadata, for this capture

    def made(self, t: Any) -> bool:
        return id(t) in self._made

    def adopt(self, fake: FakeTensor) -> None:
        """A fake made elsewhere from known metadata (a stamped call's output) that, like this runner's, is an
        autograd leaf standing for a computed tensor: in-place ops on it go through `mutate`."""
        self._made[id(fake)] = fake

    def mutate(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """An in-place op on a fake made here: apply it with the fake mode without autograd (a leaf that
        requires grad may not be changed in place under autograd, though the tensor it stands for is no
        leaf), then give the result the requires_grad autograd would have given it."""
        target = args[0]
        wants_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in tensors_of((args, kwargs)))
        with torch.no_grad():
            out = func(*args, **kwargs)
        if wants_grad and not target.requires_grad:
            target.requires_grad_(True)
        return out

    def run(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        eligible = self._eligible.get(func)
        if eligible is None:
            eligible = _eligible_name(_name(func))
            try:
                self._eligible[func] = eligible
            except TypeError:
                pass
        if (not eligible or "out" in kwargs or is_any_autocast_enabled()
                or peek_interpreter_stack() is not None):
            return NOT_HANDLED
        device: list[torch.device] = []
        try:
            key = (func, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype(),
                   _key(args), _key(kwargs))
            hash(key)
        except (_Unsupported, TypeError):
            key = None
        recipe = self._memo.get(key) if key is not None else None
        with unset_fake_temporarily():
            if recipe is not None:  # the same op on inputs with the same metadata: same output metadata
                return self._to_fake(_from_recipe(recipe), recipe_device(recipe, (args, kwargs)))
            try:
                meta_args = self._to_meta(args, device)
                meta_kwargs = self._to_meta(kwargs, device) if kwargs else kwargs
            except _Unsupported:
                return NOT_HANDLED
            if not device:
                return NOT_HANDLED
            try:
                out = func(*meta_args, **meta_kwargs)
            except Exception:  # no meta kernel, data-dependent, or a user's shape error: the fake path decides
                return NOT_HANDLED
            try:
                fake = self._to_fake(out, device[0])
            except _Unsupported:
                return NOT_HANDLED
            if key is not None:
                self._memo[key] = _recipe(out)
            return fake

    def _to_meta(self, value: Any, device: list[torch.device]) -> Any:
        if isinstance(value, torch.Tensor):
            if isinstance(value, FakeTensor):
                if value._has_symbolic_sizes_strides:
                    raise _Unsupported  # symbolic sizes: the fake mode's ShapeEnv must see every decision
                fake_device = value.fake_device
            elif type(value) in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) and value.device.type != "meta":
                fake_device = value.device  # a real parameter or buffer: no need to make it a fake first
            else:
                raise _Unsupported
            if value.layout is not torch.strided or value.is_quantized or _channels_last(value):
                raise _Unsupported  # (meta kernels do not follow CPU kernels' channels-last output layouts)
            if device and device[0] != fake_device:
                raise _Unsupported
            device[:1] = [fake_device]
            # (an inference tensor's stand-in is one too: `t.is_inference()` answers as eager, and autograd refuses
            # to save it for backward as eager does)
            with unset_fake_temporarily(), torch.inference_mode() if value.is_inference() else nullcontext():
                meta = meta_like(value.shape, value.stride(), value.storage_offset(), value.dtype)
                if value.requires_grad:
                    meta.requires_grad_(True)
            return meta
        if isinstance(value, torch.device) or isinstance(value, str) and _is_device(value):
            raise _Unsupported
        t = type(value)
        if t is tuple or t is list:
            return t(self._to_meta(v, device) for v in value)
        if t is dict:
            return {k: self._to_meta(v, device) for k, v in value.items()}
        return value

    def _to_fake(self, value: Any, device: torch.device) -> Any:
        if isinstance(value, torch.Tensor):
            if value.device.type != "meta":
                raise _Unsupported
            fake = self.make_fake(value.detach() if value.requires_grad else value, device, value.requires_grad)
            self._made[id(fake)] = fake
            return fake
        t = type(value)
        if t is list:
            return [self._to_fake(v, device) for v in value]
        if isinstance(value, tuple) and not isinstance(value, torch.Size):
            items = tuple(self._to_fake(v, device) for v in value)
            return t(*items) if hasattr(t, "_fields") else t(items)  # namedtuple | tuple, structseq
        if isinstance(value, (torch.Size, int, float, bool, type(None), torch.dtype)):
            return value
        raise _Unsupported


class _Unsupported(Exception):
    pass


def _channels_last(t: torch.Tensor) -> bool:
    dim = t.dim()
    if dim not in (4, 5) or t.is_contiguous():
        return False
    return t.is_contiguous(memory_format=torch.channels_last if dim == 4 else torch.channels_last_3d)


def _key(value: Any) -> Any:
    """A hashable key of an op's arguments: tensors by their metadata, constants by value and type."""
    if isinstance(value, torch.Tensor):
        device = value.fake_device if isinstance(value, FakeTensor) else value.device
        return ("T", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, device,
                value.requires_grad, value.layout, value.is_inference())
    t = type(value)
    if t is tuple or t is list:
        return (t, tuple(_key(v) for v in value))
    if t is dict:
        return (t, tuple((k, _key(v)) for k, v in value.items()))
    if is_constant(value):
        return const_key(value)
    raise _Unsupported


def _recipe(out: Any) -> Any:
    """The metadata of an op's (meta) outputs, enough to make new ones."""
    if isinstance(out, torch.Tensor):
        return ("T", tuple(out.shape), out.stride(), out.storage_offset(), out.dtype, out.requires_grad)
    if isinstance(out, (tuple, list)) and not isinstance(out, torch.Size):
        return (type(out), tuple(_recipe(v) for v in out))
    return ("C", out)


def _from_recipe(recipe: Any) -> Any:
    if recipe[0] == "T":
        _, shape, stride, offset, dtype, requires_grad = recipe
        meta = meta_like(shape, stride, offset, dtype)
        return meta.requires_grad_(True) if requires_grad else meta
    if recipe[0] == "C":
        return recipe[1]
    t, items = recipe
    values = tuple(_from_recipe(r) for r in items)
    if t is list:
        return list(values)
    return t(*values) if hasattr(t, "_fields") else t(values)


def meta_like(shape: Any, stride: Any, offset: int, dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor with exactly this layout, storage offset included (views keep their offsets)."""
    if not offset:
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride) if n > 0) if all(shape) else 0
    return torch.empty(offset + extent, dtype=dtype, device="meta").as_strided(shape, stride, offset)


def recipe_device(recipe: Any, args: Any) -> torch.device:
    """The device of the op's first tensor argument (all of them share it, or the op was not memoized)."""
    for t in tensors_of(args):
        return t.fake_device if isinstance(t, FakeTensor) else t.device
    raise _Unsupported


