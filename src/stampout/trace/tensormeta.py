"""The one record of a tensor's metadata (as FX's `shape_prop.TensorMetadata`), and its size-free kind.

Guards, fingerprints and structural dedup compare these records as tuples; a field set to None is one a
comparison leaves out (a fingerprint matches `requires_grad` separately; dedup holds across the class).
The generated guard predicate builds the plain tuple (`meta_values`): equal to the record, and cheaper.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..torch_internals import FakeTensor
from .shapes import show_size, size_key, sizes_key

_new = tuple.__new__  # builds a record from a tuple without NamedTuple's keyword __new__ (guards are hot)


class TensorMeta(NamedTuple):
    """Everything about a tensor that a trace can depend on without reading its values (symbolic sizes as
    their expressions, see shapes.size_key)."""

    cls: type | None
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool | None
    layout: torch.layout
    offset: Any

    def show(self) -> str:
        return (f"tensor(shape=[{', '.join(map(show_size, self.shape))}], "
                f"stride=[{', '.join(map(show_size, self.stride))}], dtype={self.dtype}, device={self.device}"
                f"{_rest(self)})")


class TensorKind(NamedTuple):
    """A tensor's metadata without its sizes, strides and offset (a symbolic capture's shape guards check those)."""

    cls: type
    ndim: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool | None
    layout: torch.layout

    def show(self) -> str:
        return f"tensor(ndim={self.ndim}, dtype={self.dtype}, device={self.device}{_rest(self)})"


class OutputMeta(NamedTuple):
    """What the fake of a region's output is made from (`Tracer.new_fake`'s arguments, in order): symbolic sizes
    as the SymInts themselves, which a new fake takes (TensorMeta holds their expressions, which compare)."""

    shape: tuple
    stride: tuple
    offset: Any
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


def output_meta(t: torch.Tensor) -> OutputMeta:
    return OutputMeta(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad)


def _rest(meta: TensorMeta | TensorKind) -> str:
    """requires_grad and the class, where the record keeps them (fingerprints show neither)."""
    grad = "" if meta.requires_grad is None else f", requires_grad={meta.requires_grad}"
    shown = meta.requires_grad is not None and meta.cls not in (torch.Tensor, torch.nn.Parameter, None)
    return grad + (f", type={meta.cls.__name__}" if shown else "")


def meta_values(t: torch.Tensor, requires_grad: bool = True) -> tuple:
    """`TensorMeta`'s fields of `t` in order, as a plain tuple (`requires_grad=False`: that field None)."""
    grad = t.requires_grad if requires_grad else None
    if type(t) is FakeTensor and t._has_symbolic_sizes_strides:
        return (type(t), sizes_key(t.shape), sizes_key(t.stride()), t.dtype, t.device, grad, t.layout,
                size_key(t.storage_offset()))
    return (type(t), tuple(t.shape), t.stride(), t.dtype, t.device, grad, t.layout, t.storage_offset())


def tensor_meta(t: torch.Tensor, requires_grad: bool = True) -> TensorMeta:
    return _new(TensorMeta, meta_values(t, requires_grad))


def kind_values(t: torch.Tensor) -> tuple:
    """`TensorKind`'s fields of `t` in order, as a plain tuple."""
    return (type(t), t.dim(), t.dtype, t.device, t.requires_grad, t.layout)


def tensor_kind(t: torch.Tensor) -> TensorKind:
    return _new(TensorKind, kind_values(t))
