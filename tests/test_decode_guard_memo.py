"""The cheap paths of an entry's per-call check on a decode step (guards/instance_facts.py, compile/entries.py):
each answers only while what it stands for is unchanged. Every test makes the change the cheap path could skip
and checks that the answer is the full check's."""

from __future__ import annotations

import torch

from stampout.guards.guard import Guard, compile_guards
from stampout.guards.instance_facts import InstanceFacts
from stampout.guards.rules import Kind
from stampout.report import annotated
from stampout.sources import Absolute, Arg, Attr, Item


class Layer:
    def __init__(self) -> None:
        self.keys = torch.zeros(2)


class Cache:
    def __init__(self, n: int) -> None:
        self.layers = [Layer() for _ in range(n)]


def _layers_distinct(n: int) -> list[Guard]:
    """`cache.layers[0]` distinct from layers 1..n-1 (the guard a decode step's reads of one class leave), and the
    input tensor `x` distinct from the tensors it read (`cache.layers[i].keys`)."""
    layers = Attr(Arg(2, "cache"), "layers")
    items = [Item(layers, i) for i in range(n)]
    keys = tuple(Attr(item, "keys") for item in items)
    return [Guard(items[0], Kind.DISTINCT, tuple(items[1:])), Guard(Arg(1, "x"), Kind.DISTINCT, keys)]


def _check(guards: list[Guard]):
    return compile_guards(guards, [Arg(2, "cache")])  # (as an entry's: it returns what it read)


def _memoized(guards: list[Guard], leaves: list) -> InstanceFacts:
    held = InstanceFacts(guards, [Arg(2, "cache")], [])
    check = _check(guards)
    assert held.run(check, leaves, None, ()) is not False  # (the full pass, which makes the memo)
    assert held.run(check, leaves, None, ()) is not False and held.hits == 1
    return held


def test_distinct_objects_the_facts_fix_are_not_read_per_call():
    cache = Cache(8)
    leaves = [None, torch.ones(2), cache]
    held = _memoized(_layers_distinct(8), leaves)
    assert "layers[5]" not in annotated(held._memo.rest)  # (the layers are fixed by the facts: no walk over them per call)


def test_a_layer_made_the_same_object_as_another_is_seen_behind_the_memo():
    cache = Cache(8)
    guards = _layers_distinct(8)
    held = _memoized(guards, [None, torch.ones(2), cache])
    check = _check(guards)
    cache.layers[5] = cache.layers[0]
    assert held.run(check, [None, torch.ones(2), cache], None, ()) is False


def test_an_input_that_is_a_tensor_the_memo_fixed_is_seen():
    """The input is compared per call with the fixed objects (by their ids), not pinned: a fresh input each call
    keeps the memo, and an input that is one of the cache's tensors fails."""
    cache = Cache(8)
    guards = _layers_distinct(8)
    held = _memoized(guards, [None, torch.ones(2), cache])
    check = _check(guards)
    for _ in range(3):
        assert held.run(check, [None, torch.ones(2), cache], None, ()) is not False
    assert held.hits == 4  # (fresh inputs: the memo answered)
    assert held.run(check, [None, cache.layers[3].keys, cache], None, ()) is False
    assert held.run(check, [None, cache.layers[0].keys, cache], None, ()) is False


def test_lifted_inputs_merge_follows_a_new_fixed_tuple():
    """The per-call merge keeps the fixed inputs in placeholder order per `known` tuple (made anew after a write):
    another tuple, even of equal length, is put in order afresh; each call's list is its own."""
    from stampout.compile.entries import _merge_order

    merge = _merge_order([True, False, True, True, False])
    a, b = ("w0", "w1", "w2"), ("v0", "v1", "v2")
    first = merge(a, ("k", "v"))
    assert first == ["w0", "k", "w1", "w2", "v"]
    first[0] = "mutated"
    assert merge(a, ("k2", "v2")) == ["w0", "k2", "w1", "w2", "v2"]
    assert merge(b, ("k", "v")) == ["v0", "k", "v1", "v2", "v"]
    assert _merge_order([True, True, False]) is None


def test_stores_from_arguments_need_no_epoch_check_between_them():
    """A replayed store's target read from the call's arguments is read afresh per store, whatever an earlier store
    wrote: no EPOCH test between such stores; one before a store whose target starts from an anchor (resolved for
    the epoch the call began in) stays."""
    from stampout.capture.effects import Effect, EffectOp, Value, ValueKind
    from stampout.compile.replay_code import compile_replay
    from stampout.sources import Anchor

    layers = Attr(Arg(2, "cache"), "layers")
    store = [Effect(EffectOp.SETATTR, Item(layers, i), "keys", (Value(ValueKind.OUT, i),), "") for i in range(3)]
    assert "_EPOCH" not in compile_replay(store).source_code
    anchored = Effect(EffectOp.SETATTR, Anchor(0, "self.block"), "last", (Value(ValueKind.OUT, 3),), "")
    code = compile_replay([*store, anchored]).source_code
    assert code.count("_EPOCH.value != epoch") == 3 and code.rstrip().endswith("return 4")


class Registry(dict):
    """A dict subclass that iterates and counts as dict does (as a watched module's `_modules`)."""

    __slots__ = ()


def _keys_of_registry(cache: Cache) -> tuple[list[Guard], list]:
    source = Attr(Arg(2, "cache"), "registry")
    return [Guard(source, Kind.KEYS, tuple(cache.registry)), Guard(source, Kind.LEN, len(cache.registry))], \
        [None, torch.ones(2), cache]


def test_keys_of_a_dict_subclass_are_settled_and_a_write_past_its_methods_is_seen():
    cache = Cache(2)
    cache.registry = Registry(a=1, b=2)
    guards, leaves = _keys_of_registry(cache)
    held = _memoized(guards, leaves)
    assert "dict keys" not in annotated(held._memo.rest)  # (its version tag fixes its keys: none read per call)
    dict.__setitem__(cache.registry, "c", 3)  # (past any method the class could define)
    assert held.run(_check(guards), leaves, None, ()) is False
    del cache.registry["c"]
    assert held.run(_check(guards), leaves, None, ()) is not False
    cache.registry.pop("a")
    cache.registry["a"] = 1  # (the same keys in another order: b, a)
    assert held.run(_check(guards), leaves, None, ()) is False


def test_keys_of_a_dict_subclass_whose_class_gains_an_iter_are_read_again():
    class Sized(dict):
        pass

    cache = Cache(2)
    cache.registry = Sized(a=1, b=2)
    guards, leaves = _keys_of_registry(cache)
    held = _memoized(guards, leaves)
    assert "dict keys" not in annotated(held._memo.rest)
    Sized.__iter__ = lambda self: iter(("b", "a"))  # (tuple() of it now iterates another way)
    assert held.run(_check(guards), leaves, None, ()) is False


def test_keys_of_a_dict_subclass_with_its_own_iter_are_read_per_call():
    class Ordered(dict):
        def __iter__(self):
            return iter(sorted(dict.keys(self)))

    cache = Cache(2)
    cache.registry = Ordered(a=1, b=2)
    guards, leaves = _keys_of_registry(cache)
    held = _memoized(guards, leaves)
    assert "dict keys" in annotated(held._memo.rest)


def _tensor_attribute(cache: Cache) -> tuple[list[Guard], list]:
    """`cache.buf.persistent` read through the tensor's own `__dict__` (the guards a Hugging Face rotary buffer's
    attribute leaves: the dict's keys and the item)."""
    attrs = Attr(Attr(Arg(2, "cache"), "buf"), "__dict__")
    return [Guard(attrs, Kind.KEYS, tuple(vars(cache.buf))), Guard(Item(attrs, "persistent"), Kind.CONST,
                                                                 (bool, False))], [None, torch.ones(2), cache]


def test_a_tensor_attribute_is_settled_and_a_write_to_it_is_seen():
    cache = Cache(2)
    cache.buf = torch.zeros(3)
    cache.buf.persistent = False
    guards, leaves = _tensor_attribute(cache)
    held = _memoized(guards, leaves)
    assert "persistent" not in annotated(held._memo.rest)  # (the tensor's dict version fixes it: not read per call)
    cache.buf.persistent = True
    assert held.run(_check(guards), leaves, None, ()) is False
    cache.buf.persistent = False
    held = _memoized(guards, leaves)
    cache.buf.__dict__["persistent"] = True
    assert held.run(_check(guards), leaves, None, ()) is False
    cache.buf.__dict__["persistent"] = False
    held = _memoized(guards, leaves)
    cache.buf.__dict__ = {"persistent": True}  # (another dict: the tensor's `__dict__` is read in C, by identity)
    assert held.run(_check(guards), leaves, None, ()) is False
    cache.buf.__dict__ = {"persistent": False}
    held = _memoized(guards, leaves)
    cache.buf = torch.zeros(3)  # (another tensor, no attribute: another dict)
    assert held.run(_check(guards), leaves, None, ()) is False


class _Base:
    pass


def test_a_class_mro_is_settled_and_a_bases_assignment_is_seen():
    class Mixed(_Base):
        pass

    mro = Attr(Absolute(Mixed, "Mixed"), "__mro__")
    guards, leaves = [Guard(mro, Kind.ID, Mixed.__mro__)], [None, torch.ones(2), Cache(2)]
    held = _memoized(guards, leaves)
    assert "__mro__" not in annotated(held._memo.rest)  # (read in C by the facts, compared by identity)
    Mixed.__bases__ = (type("Other", (_Base,), {}),)
    assert held.run(_check(guards), leaves, None, ()) is False


class _Reads(torch.nn.Module):
    """Reads each cache layer's keys (tensors read per call, lifted) and only the shape of `cache.meta`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache) -> torch.Tensor:
        for layer in cache.layers:
            x = x + layer.keys.sum(0)
        if hasattr(cache, "meta") and cache.meta.shape[0] > 2:
            x = x * 2
        return self.lin(x)


def _twins(n: int, meta: bool = True):
    import stampout

    torch.manual_seed(0)
    model, caches = _Reads(), []
    keys = [torch.randn(3, 4) for _ in range(n)]
    for _ in range(2):
        cache = Cache(0)
        cache.layers = [Layer() for _ in range(n)]
        for layer, k in zip(cache.layers, keys):
            layer.keys = k.clone()
        if meta:
            cache.meta = torch.zeros(2)
        caches.append(cache)
    return stampout.compile(model, backend="eager"), model, caches


def _same(fn, model, caches, x) -> None:
    with torch.no_grad():
        torch.testing.assert_close(fn(x, caches[0]), model(x, caches[1]))


def test_per_call_tensors_changed_in_place_behind_the_aliasing_memo_are_seen():
    """The aliasing memo's native pass stands for the per-call tensors' metadata check only where it covers them:
    a tensor whose metadata alone is read (not among them), a cache tensor resized in place at the same pointer
    (4 layers: a pointer check in Python, no metadata), and one whose requires_grad flips (20 layers, native) each
    still miss."""
    x = torch.randn(2, 4)
    fn, model, caches = _twins(20)
    for _ in range(3):
        _same(fn, model, caches, x)
    for cache in caches:
        cache.meta.resize_(5)  # (only its shape read: a deferred metadata check, not an aliased tensor)
    _same(fn, model, caches, x)
    assert fn.stats.captures == 2
    for _ in range(2):
        _same(fn, model, caches, x)
    caches[0].layers[7].keys.requires_grad_()
    caches[1].layers[7].keys.requires_grad_()
    _same(fn, model, caches, x)
    assert fn.stats.captures == 3
    fn, model, caches = _twins(4, meta=False)
    for _ in range(3):
        _same(fn, model, caches, x)
    for cache in caches:
        cache.layers[1].keys.resize_(2, 4)  # (smaller: the same data pointer)
    _same(fn, model, caches, x)
    assert fn.stats.captures == 2
