"""Inputs that share memory without being views of each other (`x` and `x.detach()`, `x.data`).

A graph traced (and functionalized) on inputs in storages of their own is wrong on inputs that share one: a
write through one must be seen through the other. structure.aliases_of keys calls by which tensors share a
storage and may overlap, views or not; these tests compare with eager on each path that keys by it."""

import pytest
import torch

import stampout
from stampout.trace.structure import aliases_of


def _write_then_read(a, b):
    a.add_(1)
    return b * 2


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("share", [torch.Tensor.detach, lambda t: t.data, lambda t: t[:]],
                         ids=["detach", "data", "view"])
def test_an_alias_of_a_written_input_sees_the_write(backend, share):
    compiled = stampout.compile(_write_then_read, backend=backend)
    compiled(torch.zeros(3), torch.zeros(3))
    x, y = torch.zeros(3), torch.zeros(3)
    torch.testing.assert_close(compiled(x, share(x)), _write_then_read(y, share(y)))
    torch.testing.assert_close(x, y)
    # and back to distinct inputs: the entry traced on distinct ones still serves them
    x, y = torch.zeros(3), torch.zeros(3)
    torch.testing.assert_close(compiled(x, torch.zeros(3)), _write_then_read(y, torch.zeros(3)))


class _Box:
    def __init__(self, a, b):
        self.a, self.b = a, b


def _write_held(box):
    box.a.mul_(3)
    return box.b + 1


def test_tensors_held_by_an_input_object_that_share_a_storage_recapture():
    compiled = stampout.compile(_write_held, backend="aot_eager")
    compiled(_Box(torch.ones(2), torch.ones(2)))
    x, y = torch.ones(2), torch.ones(2)
    torch.testing.assert_close(compiled(_Box(x, x.detach())), _write_held(_Box(y, y.detach())))
    assert compiled.stats.captures == 2


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    @stampout.region
    def forward(self, h, skip):
        skip.add_(1)
        return self.lin(h) + skip


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(3))

    def forward(self, x):
        h = x
        for i, layer in enumerate(self.layers):  # the first call gets two storages, the second one storage twice
            h = layer(h, torch.zeros(2, 4) if i == 0 else h.detach())
        return h


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_region_stamped_for_operands_that_share_a_storage_sees_the_write(backend):
    # (the tracer's fakes of views and detach() do not share storages, so the region's fingerprint cannot
    # tell the calls apart: the graph keeps the detach and the in-place add, which the backend sees on the
    # real program's aliasing)
    torch.manual_seed(0)
    model = _Stack()
    x = torch.randn(2, 4)
    compiled = stampout.compile(model, backend=backend)
    torch.testing.assert_close(compiled(x), model(x))
    torch.testing.assert_close(compiled(x + 1), model(x + 1))


def test_capture_refuses_a_call_whose_inputs_share_a_storage_unlike_at_capture():
    cap = stampout.capture(_write_then_read, torch.zeros(3), torch.zeros(3))
    x = torch.zeros(3)
    with pytest.raises(stampout.StampoutError, match="same tensor"):
        cap(x, x.detach())


def test_aliases_name_shared_storages_views_or_not():
    x = torch.zeros(6)
    assert aliases_of([x, x.detach()]) == (0, 1, ((0, 1),))
    assert aliases_of([x, x.data]) == (0, 1, ((0, 1),))
    assert aliases_of([x[:3], x[3:]]) == (0, 1)  # one storage, disjoint bytes
    assert aliases_of([x, torch.zeros(6)]) == (0, 1)
    assert aliases_of([x, 3, x.detach(), x]) == (0, 1, 2, 0, ((0, 2),))
    assert aliases_of([torch.zeros(0), x[:0], x]) == (0, 1, 2)  # empty tensors overlap nothing
    cache, flag = object(), True  # (tensors among other leaves: a decode step's inputs)
    assert aliases_of([x, cache, torch.zeros(1), flag]) == (0, 1, 2, 3)
    assert aliases_of([x, flag, torch.zeros(1), flag]) == (0, 1, 2, 1)
    assert aliases_of([x, cache, x.detach(), flag]) == (0, 1, 2, 3, ((0, 2),))


def _write_input_read_held(x, box):
    x.mul_(3)
    return box.a + box.b


def _fresh_box():
    return _Box(torch.ones(2), torch.full((2,), 2.0))


@pytest.mark.parametrize("make_input", [
    lambda box: box.a.detach(),  # the input now shares a held tensor's storage
    lambda box: box.b[:],
], ids=["detach-of-held", "view-of-held"])
def test_an_input_sharing_a_held_tensor_after_repeated_calls_is_seen(make_input):
    # (repeated calls with the same held tensors take the remembered answer: per_call_aliases.py)
    compiled = stampout.compile(_write_input_read_held, backend="aot_eager")
    box, ref = _fresh_box(), _fresh_box()
    for _ in range(3):
        torch.testing.assert_close(compiled(torch.ones(2), box), _write_input_read_held(torch.ones(2), ref))
    torch.testing.assert_close(compiled(make_input(box), box), _write_input_read_held(make_input(ref), ref))
    torch.testing.assert_close((box.a, box.b), (ref.a, ref.b))


def _write_held_a_read_held_b(x, box):
    box.a.add_(1)
    return box.b * x


def test_held_tensors_made_to_share_a_storage_in_place_are_seen():
    compiled = stampout.compile(_write_held_a_read_held_b, backend="aot_eager")
    box, ref = _fresh_box(), _fresh_box()
    for _ in range(3):
        torch.testing.assert_close(compiled(torch.ones(2), box), _write_held_a_read_held_b(torch.ones(2), ref))
    for b in (box, ref):  # the same objects, sizes and strides: only their storage changed
        b.b.set_(b.a.untyped_storage(), 0, (2,), (1,))
    torch.testing.assert_close(compiled(torch.ones(2), box), _write_held_a_read_held_b(torch.ones(2), ref))
    torch.testing.assert_close((box.a, box.b), (ref.a, ref.b))


class _WritesInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2, bias=False)

    def forward(self, x, inp):
        x.mul_(0.5)
        return self.lin(inp)


@pytest.mark.parametrize("share", [lambda p: p.data, torch.Tensor.detach, lambda p: p[:]],
                         ids=["data", "detach", "view"])
def test_an_input_sharing_a_parameters_storage_sees_the_write(share):
    # (the parameter is a fixed lifted input, checked once per write epoch: the call's inputs are compared with
    # the storages of those per call, per_call_aliases.overlaps_fixed)
    outs = []
    for compile_it in (False, True):
        torch.manual_seed(0)
        model = _WritesInput()
        fn = stampout.compile(model, backend="aot_eager") if compile_it else model
        with torch.no_grad():
            fn(torch.ones(2, 2), torch.ones(1, 2))
            outs.append((fn(share(model.lin.weight), torch.ones(1, 2)), model.lin.weight.clone()))
    torch.testing.assert_close(outs[1], outs[0])
