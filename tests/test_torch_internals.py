"""torch_internals is the one seam to torch's private names and permanent patches: names resolve lazily from its
table, patches go through `patch_permanently`, and every target exists on this torch."""

from __future__ import annotations

import types

import pytest
import torch

from stampout import torch_internals


def test_names_resolve_to_torchs_objects():
    import torch.utils._pytree as torch_pytree
    from torch._subclasses.fake_tensor import FakeTensor as TorchFakeTensor

    from stampout.torch_internals import DisableTorchFunction, FakeTensor, pytree

    assert FakeTensor is TorchFakeTensor
    assert DisableTorchFunction is torch._C.DisableTorchFunction
    assert pytree is torch_pytree
    assert set(torch_internals.NAMES.values()) <= set(torch_internals.PRIVATE_NAMES)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'not_a_torch_name'"):
        torch_internals.not_a_torch_name  # noqa: B018


def test_a_name_this_torch_lacks_says_which_torch_to_install(monkeypatch):
    monkeypatch.setitem(torch_internals.NAMES, "gone_name", "torch._subclasses.fake_tensor.NoSuchThing")
    with pytest.raises(ImportError, match=r"torch._subclasses.fake_tensor.NoSuchThing.*torch>=2.13,<2.15"):
        torch_internals.gone_name  # noqa: B018


def test_every_private_name_and_patch_target_exists_in_this_torch():
    assert torch_internals.missing_private_names() == [], torch.__version__
    assert set(torch_internals.PATCH_TARGETS) <= set(torch_internals.PRIVATE_NAMES)


def test_permanent_patches_are_recorded_and_only_on_listed_private_targets(monkeypatch):
    fresh: list = []  # (the registry's list, which the package re-exports)
    monkeypatch.setattr(torch_internals.registry, "PERMANENT_PATCHES", fresh)
    monkeypatch.setattr(torch_internals, "PERMANENT_PATCHES", fresh)
    owner = types.SimpleNamespace(f=len)
    with pytest.raises(ValueError, match="not in torch_internals.PATCH_TARGETS"):
        torch_internals.patch_permanently(owner, "f", abs, "torch._inductor.somewhere.f", "test")
    assert owner.f is len and torch_internals.PERMANENT_PATCHES == []
    assert torch_internals.patch_permanently(owner, "f", abs, "torch.utils.f", "a public target") is len
    assert owner.f is abs
    assert torch_internals.PERMANENT_PATCHES == [torch_internals.Patch("torch.utils.f", "a public target")]


def test_parameter_writes_are_a_recorded_patch():
    from stampout.compile import function as compiled  # noqa: F401 - importing it makes no patch; compiling does

    torch_internals.patch_parameter_writes(lambda: None)  # (idempotent: the compiled functions' epoch, once)
    targets = {p.target for p in torch_internals.PERMANENT_PATCHES}
    assert {"torch.nn.Parameter.data", "torch.utils.swap_tensors"} <= targets
