"""Inputs that share memory without being views of each other (`x` and `x.detach()`).

structure.aliases_of looks for overlapping inputs only when one of them is a view (`Tensor._is_view()`), and
`detach()` shares its input's storage without being a view: a graph functionalized on distinct inputs is then
reused on aliased ones. Known bug, found 2 Dec; the test flips when it is fixed."""

import pytest
import torch

import stampout


def _write_then_read(a, b):
    a.add_(1)
    return b * 2


@pytest.mark.xfail(strict=True, reason="aliases_of misses storage shared through detach() (not a view)")
def test_detached_alias_of_a_written_input_sees_the_write():
    compiled = stampout.compile(_write_then_read, backend="aot_eager")
    compiled(torch.zeros(3), torch.zeros(3))
    x, y = torch.zeros(3), torch.zeros(3)
    torch.testing.assert_close(compiled(x, x.detach()), _write_then_read(y, y.detach()))


def test_a_view_alias_of_a_written_input_sees_the_write():
    compiled = stampout.compile(_write_then_read, backend="aot_eager")
    compiled(torch.zeros(3), torch.zeros(3))
    x, y = torch.zeros(3), torch.zeros(3)
    torch.testing.assert_close(compiled(x, x[:]), _write_then_read(y, y[:]))
