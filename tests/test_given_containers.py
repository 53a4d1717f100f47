"""Containers the program is given and changes in place (a set argument, a list an input object holds, a list
argument the capture runs on as a copy): the capture leaves them as one eager call leaves them (real values,
no fake, no attribute lost), and each compiled call changes the call's own containers as eager does (set
members added: replayed; removed: refused with an error)."""

import collections
import logging

import pytest
import torch

import stampout
from stampout.torch_internals import FakeTensor


def _adds_tensor(x, bag):
    bag.add(x * 2)
    return x + 1


def _adds_size(x, bag):
    bag.add(len(bag) + 10)
    return x + 1


class _Box:
    def __init__(self):
        self.seen = set()


def _adds_to_held_set(x, box):
    box.seen.add(x.shape[0])
    return x + 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_tensor_added_to_a_given_set_is_the_calls_real_value(backend):
    compiled = stampout.compile(_adds_tensor, backend=backend)
    for _ in range(3):
        x, bag = torch.randn(3), set()
        torch.testing.assert_close(compiled(x, bag), x + 1)
        (member,) = bag
        assert type(member) is torch.Tensor and not isinstance(member, FakeTensor)
        torch.testing.assert_close(member, x * 2)
    assert compiled.stats.captures == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_constant_added_to_a_given_set_is_added_on_every_call(backend):
    compiled = stampout.compile(_adds_size, backend=backend)
    for _ in range(3):
        bag = set()
        compiled(torch.ones(2), bag)
        assert bag == {10}


def test_a_member_added_to_a_set_held_by_an_input_object_is_added_on_every_call():
    compiled = stampout.compile(_adds_to_held_set, backend="eager")
    for n in (3, 3, 3):
        box, ref = _Box(), _Box()
        compiled(torch.ones(n), box)
        _adds_to_held_set(torch.ones(n), ref)
        assert box.seen == ref.seen == {n}


def _removes(x, bag):
    bag.discard(1)
    return x + 1


def test_a_member_removed_from_a_given_set_runs_eagerly(caplog):
    compiled = stampout.compile(_removes, backend="eager")
    with caplog.at_level(logging.WARNING, logger="stampout.guards"):
        for _ in range(2):
            bag = {1, 2}
            torch.testing.assert_close(compiled(torch.ones(2), bag), torch.full((2,), 2.0))
            assert bag == {2}  # (as the eager call leaves it)
    assert "removes members of bag" in caplog.text
    with pytest.raises(stampout.CaptureError, match="removes members of bag"):
        stampout.compile(_removes, backend="eager", fullgraph=True)(torch.ones(2), {1, 2})


def test_capture_refuses_to_call_again_a_program_that_changes_a_given_set():
    bag = set()
    cap = stampout.capture(_adds_tensor, torch.ones(2), bag)
    (member,) = bag  # the capture ran the Python once, as one eager call: with the real value
    assert type(member) is torch.Tensor
    torch.testing.assert_close(member, torch.full((2,), 2.0))
    with pytest.raises(stampout.StampoutError, match="changes the items of bag|differs from the captured one"):
        cap(torch.ones(2), set())  # (refused: the set it was given is keyed as it was, its change not repeated)


class _Holder:
    pass


def _appends_to_held_list(x, holder):
    holder.items.append(x * 2)
    return x + 1


def test_capture_leaves_a_held_list_it_appended_to_with_the_real_value():
    holder, ref = _Holder(), _Holder()
    holder.items, ref.items = [torch.zeros(1)], [torch.zeros(1)]
    stampout.capture(_appends_to_held_list, torch.ones(2), holder)
    _appends_to_held_list(torch.ones(2), ref)
    assert len(holder.items) == 2 and all(type(t) is torch.Tensor for t in holder.items)
    torch.testing.assert_close(holder.items, ref.items)


def _appends(x, bag):
    bag.append(x * 2)
    return x + 1


def test_capture_appends_to_a_given_list_as_one_eager_call():
    first = torch.zeros(1)
    bag, ref = [first], [torch.zeros(1)]
    stampout.capture(_appends, torch.ones(2), bag)
    _appends(torch.ones(2), ref)
    assert bag[0] is first and type(bag[1]) is torch.Tensor
    torch.testing.assert_close(bag, ref)


def _stores_into(x, d):
    d["new"] = x * 3
    return x + d["a"]


def _appends_under_a_default(x, d):
    d["k"].append(x * 2)
    return x + 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fn, make", [
    (_stores_into, lambda: collections.OrderedDict(a=torch.ones(2))),
    (_stores_into, lambda: collections.defaultdict(int, a=torch.ones(2))),
    (_appends_under_a_default, lambda: collections.defaultdict(list)),
], ids=["OrderedDict", "defaultdict", "defaultdict-of-lists"])
def test_a_given_dict_subclass_is_changed_on_every_call_as_eager_changes_it(backend, fn, make):
    # (dict subclasses are opened into leaves like dicts, and the program runs on a copy: its stores into
    # them were dropped, not replayed)
    compiled = stampout.compile(fn, backend=backend)
    for _ in range(3):
        x, d, ref = torch.randn(2), make(), make()
        torch.testing.assert_close(compiled(x, d), fn(x, ref))
        assert type(d) is type(ref) and list(d) == list(ref)
        torch.testing.assert_close(dict(d), dict(ref))


def test_capture_stores_into_a_given_ordered_dict_as_one_eager_call():
    d, ref = collections.OrderedDict(a=torch.ones(2)), collections.OrderedDict(a=torch.ones(2))
    cap = stampout.capture(_stores_into, torch.ones(2), d)
    _stores_into(torch.ones(2), ref)
    torch.testing.assert_close(dict(d), dict(ref))
    again, ref = collections.OrderedDict(a=torch.ones(2)), collections.OrderedDict(a=torch.ones(2))
    torch.testing.assert_close(cap(torch.ones(2), again), _stores_into(torch.ones(2), ref))
    torch.testing.assert_close(dict(again), dict(ref))


class _Pair(tuple):
    def __new__(cls, a, b, tag="p"):
        pair = super().__new__(cls, (a, b))
        pair.tag = tag
        return pair


def _by_tag(pair):
    return pair[0] * (2 if pair.tag == "p" else 3) + pair[1]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_an_attribute_of_a_tuple_subclass_argument_is_guarded(backend):
    compiled = stampout.compile(_by_tag, backend=backend)
    for tag in ("p", "q", "p"):
        pair = _Pair(torch.ones(2), torch.ones(2), tag=tag)
        torch.testing.assert_close(compiled(pair), _by_tag(pair))
