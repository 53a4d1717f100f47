"""FakeTensor construction from a meta tensor without its Python constructor's argument handling.

`FakeTensor(mode, elem, device)` costs ~8 us, most of it checking keyword arguments, normalizing the device and
setting each field through its descriptor; a stamped region call makes one per output. `FakeMaker` makes the first
fake per device with the constructor and keeps the fields it set (all constant: the mode, the normalized device,
empty memos); later fakes are `Tensor._make_subclass` plus those fields, ~1.5 us. Where the constructor would do
more (a debug traceback, export's leak tracker) or its fields are not the
ones checked here (another torch), every fake is made by the constructor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig

# What FakeTensor.__new__ sets on a new fake from (mode, elem, device), no constant, no real tensor (torch 2.13/2.14)
_FIELDS = frozenset({"_fake_device", "fake_mode", "constant", "pytype", "dispatch_keys", "real_tensor",
                     *(f"_{memo}{suffix}" for memo in ("nonzero_memo", "item_memo", "unique_memo",
                                                       "unique_consecutive_memo", "nested_int_memo")
                       for suffix in ("", "_vc", "_epoch"))})
_make_subclass = torch.Tensor._make_subclass
_THROW_ON_DATA_PTR = torch._C._set_throw_on_mutable_data_ptr
_WARN_ON_DATA_PTR = torch._C._set_warn_deprecated_on_mutable_data_ptr


class FakeMaker:
    """Makes fakes of one fake mode from meta tensors (see the module docstring)."""

    __slots__ = ("mode", "_fields", "_on_data_ptr")

    def __init__(self, mode: Any) -> None:
        self.mode = mode
        self._on_data_ptr = _WARN_ON_DATA_PTR if mode._allow_unsafe_data_ptr_access else _THROW_ON_DATA_PTR
        self._fields: dict[torch.device, dict[str, Any] | None] = {}  # device -> the fields, None: constructor

    def __call__(self, elem: torch.Tensor, device: torch.device, requires_grad: bool | None = None) -> FakeTensor:
        """`FakeTensor(mode, elem, device, requires_grad=requires_grad)`."""
        fields = self._fields.get(device)
        if fields is None or FakeTensorConfig.debug or torch.compiler.is_exporting():
            fake = FakeTensor(self.mode, elem, device, requires_grad=requires_grad)
            if device not in self._fields:
                self._fields[device] = self._template(fake, device)
            return fake
        grad = elem.requires_grad if requires_grad is None else requires_grad
        fake = _make_subclass(FakeTensor, elem, grad, dispatch_device=True,
                              device_for_backend_keys=fields["_fake_device"])
        self._on_data_ptr(fake)
        fake.__dict__.update(fields)
        return fake

    def _template(self, fake: FakeTensor, device: torch.device) -> dict[str, Any] | None:
        fields = dict(fake.__dict__)
        plain = (fields.keys() == _FIELDS and fields["fake_mode"] is self.mode and fields["_fake_device"] == device
                 and (self.mode._allow_unsafe_data_ptr_access is (self._on_data_ptr is _WARN_ON_DATA_PTR))
                 and all(v is None for k, v in fields.items() if k not in ("_fake_device", "fake_mode")))
        return fields if plain else None
