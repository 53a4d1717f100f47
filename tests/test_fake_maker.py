"""`torch_internals.FakeMaker` makes the fake `FakeTensor(mode, elem, device, requires_grad=...)` makes (its fields,
dispatch keys, device, requires_grad, and how ops on it run), and falls back to the constructor where that does more."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig, FakeTensorMode

from stampout.torch_internals import FakeMaker, unset_fake_temporarily


def _describe(fake: FakeTensor) -> tuple:
    fields = {k: v for k, v in fake.__dict__.items()}
    return (type(fake), fields, str(torch._C._dispatch_keys(fake)), fake.device, fake.requires_grad, fake.shape,
            fake.stride(), fake.storage_offset(), fake.dtype, fake.is_leaf)


def _elem(requires_grad: bool = False) -> torch.Tensor:
    return torch.empty_strided((2, 3), (1, 2), dtype=torch.float16, device="meta").requires_grad_(requires_grad)


def test_fake_maker_makes_what_the_constructor_makes() -> None:
    mode = FakeTensorMode()
    make = FakeMaker(mode)
    cpu = torch.device("cpu")
    with unset_fake_temporarily():
        first = make(_elem(), cpu)  # (the constructor, which shows the fields)
        for grad in (None, True, False):
            fast, slow = make(_elem(), cpu, grad), FakeTensor(mode, _elem(), cpu, requires_grad=grad)
            assert _describe(fast) == _describe(slow)
        fast, slow = make(_elem(True), cpu), FakeTensor(mode, _elem(True), cpu)
        assert _describe(fast) == _describe(slow) and fast.requires_grad
    assert _describe(first) == _describe(make(_elem(), cpu))
    with mode:
        out = make(_elem(), cpu) * 2  # ops on it dispatch through the fake mode
    assert isinstance(out, FakeTensor) and out.fake_mode is mode and out.shape == (2, 3)


def test_fake_maker_keeps_fields_per_mode_and_device() -> None:
    mode, other = FakeTensorMode(), FakeTensorMode()
    make = FakeMaker(mode)
    with unset_fake_temporarily():
        make(_elem(), torch.device("cpu"))
        fake = make(_elem(), torch.device("cpu"))
        meta_mode = FakeTensorMode()
        meta_mode.allow_meta = True
        on_meta = FakeMaker(meta_mode)
        on_meta(_elem(), torch.device("meta"))
        fake_meta = on_meta(_elem(), torch.device("meta"))
    assert fake.fake_mode is mode and fake.fake_mode is not other
    assert fake_meta.device == torch.device("meta") and fake_meta.fake_mode is meta_mode


def test_fake_maker_uses_the_constructor_in_debug_mode() -> None:
    mode = FakeTensorMode()
    make = FakeMaker(mode)
    with unset_fake_temporarily():
        make(_elem(), torch.device("cpu"))
        old = FakeTensorConfig.debug
        FakeTensorConfig.debug = True
        try:
            fake = make(_elem(), torch.device("cpu"))
        finally:
            FakeTensorConfig.debug = old
    assert hasattr(fake, "_debug_trace")  # (what only the constructor records)


def _data_ptr_refusal(fake: FakeTensor) -> str:
    """What reading a fake's data pointer does: "raises", or "warns" (torch warns once a process)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fake.data_ptr()
        except RuntimeError:
            return "raises"
    return "warns"


def test_fake_maker_refuses_data_pointers_as_the_constructor_does() -> None:
    for allow in (True, False):
        mode = FakeTensorMode()
        mode._allow_unsafe_data_ptr_access = allow
        make = FakeMaker(mode)
        with unset_fake_temporarily():
            make(_elem(), torch.device("cpu"))
            fast, slow = make(_elem(), torch.device("cpu")), FakeTensor(mode, _elem(), torch.device("cpu"))
        assert make._fields[torch.device("cpu")] is not None  # (the fast path was taken)
        assert _data_ptr_refusal(fast) == _data_ptr_refusal(slow) == ("warns" if allow else "raises")
