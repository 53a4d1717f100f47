"""`stampout.capture` runs the program's Python once and leaves the objects and tensors the caller passed as one
eager call leaves them (SPEC §3): an in-place write to a plain tensor argument happens at capture as it does to a
tensor an input object holds (`box.a`, a KV cache's layers). The module's own tensors (BatchNorm's statistics)
are left alone: each call of the Capture updates them."""

import dataclasses

import pytest
import torch
from torch import nn

import stampout


class Box:
    def __init__(self, a):
        self.a = a


@dataclasses.dataclass
class Held:
    a: torch.Tensor


def writes_argument(x):
    x.add_(1.0)
    return x * 2


def writes_argument_and_held(x, box):
    box.a.add_(1.0)
    x.mul_(3.0)
    return x + box.a


@pytest.mark.parametrize("holder", [Box, Held], ids=["object", "dataclass"])
def test_capture_writes_a_plain_argument_as_it_writes_a_held_tensor(holder):
    x, box = torch.ones(3), holder(torch.zeros(3))
    ex, ebox = torch.ones(3), holder(torch.zeros(3))
    cap = stampout.capture(writes_argument_and_held, x, box)
    writes_argument_and_held(ex, ebox)
    torch.testing.assert_close((x, box.a), (ex, ebox.a))  # after the capture: as after one eager call
    torch.testing.assert_close(cap(x, box), writes_argument_and_held(ex, ebox))  # the Capture's call: a second
    torch.testing.assert_close((x, box.a), (ex, ebox.a))


def test_capture_writes_a_plain_tensor_argument_once():
    x = torch.zeros(3)
    cap = stampout.capture(writes_argument, x)
    torch.testing.assert_close(x, torch.ones(3))
    torch.testing.assert_close(cap(x), torch.full((3,), 4.0))
    torch.testing.assert_close(x, torch.full((3,), 2.0))


def test_capture_writes_a_view_argument_through_to_its_base():
    base = torch.zeros(2, 3)
    stampout.capture(writes_argument, base[0])
    torch.testing.assert_close(base, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


def test_capture_leaves_the_modules_buffers_to_the_captures_calls():
    model = nn.BatchNorm1d(3).train()
    x = torch.randn(4, 3)
    cap = stampout.capture(model, x)
    torch.testing.assert_close(model.running_mean, torch.zeros(3))
    cap(x)
    assert not torch.equal(model.running_mean, torch.zeros(3))
