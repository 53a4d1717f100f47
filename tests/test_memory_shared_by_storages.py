"""Tensors that share memory through two different storages: `torch.from_numpy(a.numpy())` beside `a`, or
`from_numpy` of one array twice. Storage objects differ, the bytes are the same; a graph traced on their fakes
(one fake storage per real storage) takes them as apart, so a write through one is lost through the other.

Which tensors share memory is told by the bytes their storages span (trace/memory.py): a compiled entry traced on
tensors apart is not run on such ones, and a capture that would read them refuses (`compile` runs that call
eagerly, with eager's results)."""

import numpy as np
import pytest
import torch
from torch import nn

import stampout
from stampout.trace.structure import aliases_of


class Box:
    def __init__(self, a):
        self.a = a


def write_held_read_input(x, box):
    box.a.add_(1.0)
    return x * 2


def write_second_read_first(x, y):
    y.mul_(3)
    return x + 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_an_input_over_the_memory_of_a_held_tensor_sees_its_write(backend):
    compiled = stampout.compile(write_held_read_input, backend=backend)
    for _ in range(2):  # (the entry is traced on tensors apart)
        compiled(torch.zeros(4), Box(torch.zeros(4)))
    a, b = torch.zeros(4), torch.zeros(4)
    out = compiled(torch.from_numpy(a.numpy()), Box(a))
    torch.testing.assert_close(out, write_held_read_input(torch.from_numpy(b.numpy()), Box(b)))
    torch.testing.assert_close(out, torch.full((4,), 2.0))
    torch.testing.assert_close(a, b)
    # and apart again: the compiled entry still serves
    torch.testing.assert_close(compiled(torch.ones(4), Box(torch.zeros(4))), torch.full((4,), 2.0))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("part", [slice(None), slice(2, None)], ids=["whole", "tail"])
def test_two_inputs_from_one_array_see_each_others_writes(backend, part):
    compiled = stampout.compile(write_second_read_first, backend=backend)
    compiled(torch.ones(4), torch.ones(4))
    arrays = [np.ones(6, dtype=np.float32) for _ in range(2)]
    outs = [fn(torch.from_numpy(a[part]), torch.from_numpy(a[2:]))
            for fn, a in zip((compiled, write_second_read_first), arrays)]
    torch.testing.assert_close(outs[0], outs[1])
    np.testing.assert_array_equal(arrays[0], arrays[1])


def test_an_input_over_a_buffers_memory_sees_the_buffer():
    class Doubles(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.ones(4))

        def forward(self, x):
            x.add_(1)
            return self.b * 2

    model = Doubles()
    compiled = stampout.compile(model, backend="aot_eager")
    compiled(torch.zeros(4))
    out = compiled(torch.from_numpy(model.b.numpy()))
    torch.testing.assert_close(out, torch.full((4,), 4.0))
    torch.testing.assert_close(model.b, torch.full((4,), 2.0))


def test_capture_refuses_tensors_sharing_memory_through_two_storages():
    a = torch.zeros(4)
    with pytest.raises(stampout.StampoutError, match="share memory through two different storages"):
        stampout.capture(write_held_read_input, torch.from_numpy(a.numpy()), Box(a))
    torch.testing.assert_close(a, torch.zeros(4))  # (the capture put the world back)


def test_aliases_of_tells_storages_over_one_memory_by_their_bytes():
    array = np.zeros(8, dtype=np.float32)
    whole, tail, head = torch.from_numpy(array), torch.from_numpy(array[4:]), torch.from_numpy(array[:4])
    assert aliases_of([whole, torch.from_numpy(array)]) == (0, 1, ((0, 1),))
    assert aliases_of([whole, tail]) == (0, 1, ((0, 1),))
    assert aliases_of([head, tail]) == (0, 1)  # (the halves of one array do not overlap)
    assert aliases_of([torch.zeros(4), torch.zeros(4)]) == (0, 1)


def test_the_remembered_per_call_answer_does_not_cover_an_input_over_part_of_a_held_tensor():
    # (the same held tensor at the same address, call after call: the per-call check remembers its answer and
    # then only asks whether the inputs' memory is apart from the held tensors')
    compiled = stampout.compile(write_held_read_input, backend="aot_eager")
    a, b = torch.zeros(6), torch.zeros(6)
    held, expected_held = Box(a), Box(b)
    for _ in range(3):
        compiled(torch.zeros(4), held)
        write_held_read_input(torch.zeros(4), expected_held)
    out = compiled(torch.from_numpy(a.numpy()[2:]), held)
    torch.testing.assert_close(out, write_held_read_input(torch.from_numpy(b.numpy()[2:]), expected_held))
    torch.testing.assert_close(a, b)


def test_storages_torch_allocated_are_listed_until_one_over_other_memory_comes(monkeypatch):
    """(trace/memory.py) A stamped layer's parameters are torch's own storages: no span is computed for them until a
    storage over memory torch did not allocate for it is claimed, which still finds the one whose memory it is."""
    from stampout.trace import memory

    spans = []
    span_of = memory.memory_span
    monkeypatch.setattr(memory, "memory_span", lambda *a: spans.append(a) or span_of(*a))
    claimed = memory.CapturedMemory()
    params = [torch.zeros(4) for _ in range(5)]
    for i, p in enumerate(params):
        assert claimed.claim(p, f"p{i}") is None
        assert claimed.claim(p[1:], f"p{i} again") is None  # (a view: the same storage)
    assert spans == []
    assert claimed.claim(torch.from_numpy(params[3].numpy()[2:]), "over p3") == "p3"
    assert claimed.claim(torch.zeros(4), "another") is None
    assert claimed.claim(torch.from_numpy(np.zeros(4, dtype=np.float32)), "apart") is None


class OverItsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.view = torch.from_numpy(self.lin.weight.detach().numpy())  # (read after the weight)

    def forward(self, x):
        return self.lin(x) + self.view.sum()


def test_capture_refuses_an_attribute_over_the_memory_of_a_parameter_read_before_it():
    with pytest.raises(stampout.StampoutError, match="share memory through two different storages"):
        stampout.capture(OverItsWeight(), torch.zeros(2, 4))
