"""Guards and fingerprints, property-tested: the generated predicate agrees with the guard-by-guard check,
constants compare with their type, and fingerprints separate what a trace could depend on."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stampout.guards.guard import Guard, Kind, compile_guards, const_key, first_failure, tensor_meta
from stampout.regions.fingerprint import fingerprint
from stampout.sources import Arg, Attr, CallContext, Item
from stampout.trace.structure import flatten_inputs

scalars = st.one_of(st.integers(-3, 3), st.floats(allow_nan=True, allow_infinity=True, width=32), st.booleans(),
                    st.text(max_size=3), st.none())
constants = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.tuples(inner, inner),
                                                          st.dictionaries(st.text(max_size=2), inner, max_size=3)),
                         max_leaves=6)


@given(constants, constants)
def test_const_key_equal_exactly_for_same_type_and_value(a, b):
    def same(x, y):
        if type(x) is not type(y):
            return False
        if isinstance(x, float):
            return repr(x) == repr(y)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(same(p, q) for p, q in zip(x, y))
        if isinstance(x, dict):
            return list(x) == list(y) and all(same(x[k], y[k]) for k in x)
        return x == y

    assert (const_key(a) == const_key(b)) == same(a, b)


def test_one_one_point_oh_and_true_differ():
    assert len({const_key(1), const_key(1.0), const_key(True)}) == 3


class Holder:
    def __init__(self, value, items):
        self.value = value
        self.items = items


@settings(max_examples=60, deadline=None)
@given(constants, constants, st.lists(st.integers(0, 3), min_size=1, max_size=4), st.booleans())
def test_generated_predicate_agrees_with_each_guard(expected, actual, shape, requires_grad):
    old = Holder(expected, [torch.zeros(*shape)])
    new = Holder(actual, [torch.zeros(*shape[::-1], requires_grad=requires_grad)])
    root = Arg(0, "self")
    guards = [
        Guard(Attr(root, "value"), Kind.CONST, const_key(old.value)),
        Guard(Item(Attr(root, "items"), 0), Kind.TENSOR, tensor_meta(old.items[0])),
        Guard(Attr(root, "missing"), Kind.ABSENT, None),
    ]
    check = compile_guards(guards)
    for obj in (old, new):
        ctx = CallContext([obj], None)
        assert bool(check(ctx.leaves, ctx.fn)) == (first_failure(guards, ctx) is None)
    assert check([old], None)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=3), st.sampled_from([torch.float32, torch.float64]),
       st.booleans(), constants)
def test_fingerprint_separates_metadata_and_constants(shape, dtype, transpose, constant):
    t = torch.zeros(*shape, dtype=dtype)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, 1)

    def fp(x, c):
        leaves, spec, _ = flatten_inputs((x, c), {})
        return fingerprint(spec, leaves)

    assert fp(t, constant) == fp(t.clone().as_strided(t.shape, t.stride()), constant)
    assert fp(t, constant) != fp(t.to(torch.float16), constant)
    assert fp(t, constant) != fp(t, [constant])
    if t.dim() >= 2 and t.shape[0] != t.shape[1]:
        assert fp(t, constant) != fp(t.transpose(0, 1).contiguous(), constant)


def _with_cell(value):
    def fn():
        return value

    return fn


def test_predicate_on_closure_cells_agrees_with_each_guard_empty_and_missing_cells_included():
    """Cells read inline (`fn.__closure__[0].cell_contents`, and through an argument's `__closure__`): a new value,
    an emptied cell (ValueError, not AttributeError), no closure or no function at all fail the check, never
    raise, as the guard-by-guard check answers."""
    from stampout.sources import Closure

    emptied = _with_cell(2)
    del emptied.__closure__[0].cell_contents
    cases = [(_with_cell(2), True), (_with_cell(3), False), (_with_cell(2.0), False), (emptied, False),
             (lambda: 2, False), (Holder(2, []), False)]
    for source in (Closure(0, "value"), Attr(Item(Attr(Arg(0, "g"), "__closure__"), 0), "cell_contents")):
        guards = [Guard(source, Kind.CONST, const_key(2))]
        check = compile_guards(guards)
        for fn, admitted in cases:
            ctx = CallContext([fn], fn)
            assert bool(check(ctx.leaves, ctx.fn)) is admitted, (source, fn)
            assert (first_failure(guards, ctx) is None) is admitted, (source, fn)


def test_arguments_that_are_all_leaves_flatten_as_the_walk_does(monkeypatch):
    """flatten_inputs takes arguments none of which is a tuple, list or dict without its walk: the same leaves, spec
    and labels as the walk gives (forced here by making every value look openable)."""
    from stampout.trace import structure

    class Box:
        pass

    x = torch.ones(2)
    calls = [((), {"input_ids": x, "past_key_values": Box(), "cache_position": x, "use_cache": True}),
             ((x, 3, "s", None, 1.5), {}), ((x, Box()), {"flag": False, "size": torch.Size([2])})]
    fast = [flatten_inputs(args, kwargs, names) for args, kwargs in calls for names in ((), ("self", "h"))]
    monkeypatch.setattr(structure, "_OPENED", object)
    walked = [flatten_inputs(args, kwargs, names) for args, kwargs in calls for names in ((), ("self", "h"))]
    assert fast == walked
