"""TensorMeta / TensorKind: the one record of tensor metadata that guards, fingerprints and dedup compare."""

from __future__ import annotations

import torch

from stampout.guards.guard import Guard, Kind
from stampout.regions.fingerprint import (
    Fingerprint,
    LeafKey,
    LeafKind,
    as_leaf_key,
    describe_difference,
    fingerprint,
    leaf_key,
    state_key,
    without_sizes,
)
from stampout.sources import Arg
from stampout.trace.tensormeta import TensorKind, TensorMeta, kind_values, meta_values, tensor_kind, tensor_meta


def test_fields_by_name_and_equal_to_the_plain_tuple_the_guard_builds():
    t = torch.randn(2, 3, dtype=torch.float64).t()
    meta = tensor_meta(t)
    assert isinstance(meta, TensorMeta)
    assert (meta.cls, meta.shape, meta.stride, meta.dtype, meta.requires_grad, meta.offset) == (
        torch.Tensor, (3, 2), (1, 3), torch.float64, False, 0)
    assert meta == meta_values(t) and hash(meta) == hash(meta_values(t))
    kind = tensor_kind(t)
    assert (kind.ndim, kind.requires_grad) == (2, False) and kind == kind_values(t)


def test_requires_grad_left_out_of_the_fingerprint_leaf():
    a, b = torch.randn(2), torch.randn(2, requires_grad=True)
    assert leaf_key(a) == leaf_key(b)
    assert as_leaf_key(leaf_key(a)).value.requires_grad is None
    assert tensor_meta(a) != tensor_meta(b)


def test_without_sizes_keeps_the_kind():
    leaves = [torch.randn(2, 3)]
    key = without_sizes(fingerprint((), leaves), [torch.randn(5, 7)])
    kind = TensorKind(torch.Tensor, 2, torch.float32, torch.device("cpu"), None, torch.strided)
    assert isinstance(key, Fingerprint) and key.leaves[0] == LeafKey(LeafKind.TENSOR, kind)
    assert key.state == state_key() and key.aliases == (0,)


def test_fingerprint_parts_are_named_and_compare_as_plain_tuples():
    x = torch.randn(2)
    x.scale = 2.0
    key = fingerprint(((None,), ()), [x, 3, torch.nn.Linear(1, 1)])
    leaves = [as_leaf_key(leaf) for leaf in key.leaves]
    assert [leaf.kind for leaf in leaves] == [LeafKind.TENSOR, LeafKind.CONSTANT, LeafKind.MODULE]
    assert leaves[0].detail == ("scale",) and leaves[2].value is torch.nn.Linear
    assert key.state.grad_mode is torch.is_grad_enabled() and key.state.default_dtype is torch.get_default_dtype()
    assert key == tuple(key) and hash(key) == hash(tuple(tuple(part) if isinstance(part, tuple) else part
                                                         for part in key))
    with torch.no_grad():
        other = fingerprint(((None,), ()), [x, 3, torch.nn.Linear(1, 1)])
    assert describe_difference(key, other, ["x", "n", "m"]) == "grad mode: expected True, got False"


def test_guard_and_fingerprint_print_the_same_shape():
    x, y = torch.randn(2, 3), torch.randn(4, 3)
    guard = Guard(Arg(0, "x"), Kind.TENSOR, tensor_meta(x))
    assert guard.expected_text() == ("tensor(shape=[2, 3], stride=[3, 1], dtype=torch.float32, device=cpu, "
                                     "requires_grad=False)")
    assert describe_difference(fingerprint((), [x]), fingerprint((), [y]), ["x"]) == (
        "x: expected tensor(shape=[2, 3], stride=[3, 1], dtype=torch.float32, device=cpu), "
        "got tensor(shape=[4, 3], stride=[3, 1], dtype=torch.float32, device=cpu)")


def test_symbolic_sizes_print_as_expressions_in_guards_too():
    meta = TensorMeta(torch.Tensor, (("sym", None, "s0"), 3), (3, 1), torch.float32, torch.device("cpu"), False,
                      torch.strided, 0)
    assert Guard(Arg(0, "x"), Kind.TENSOR, meta).expected_text().startswith("tensor(shape=[s0, 3], stride=[3, 1]")


def test_a_kind_guard_shows_requires_grad_and_the_class():
    p = torch.nn.Parameter(torch.randn(2))
    guard = Guard(Arg(0, "x"), Kind.TENSOR_KIND, tensor_kind(p))
    assert guard.expected_text() == "tensor(ndim=1, dtype=torch.float32, device=cpu, requires_grad=True)"
    assert guard.observe(torch.randn(2)) == "tensor(ndim=1, dtype=torch.float32, device=cpu, requires_grad=False)"
