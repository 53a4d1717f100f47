"""After automatic dynamic recapture (a second call with another size, or an int attribute that changed), the
program's Python holds SymInts. Where it turns one into text (`f"rows={x.shape[0]}"`, `str(x.shape)`,
`'{:03d}'.format(n)`, a log list) the text is eager's, never a symbol's name, for every later call; where Python
refuses a SymInt eager has as an int (`divmod(n, 4)`, a user `__index__` returning it) compile captures that input
structure with static sizes instead of raising. Differential against eager, call by call."""

from __future__ import annotations

import json
import threading
import time

import torch
from torch import nn

import stampout


class Describes(nn.Module):
    def forward(self, x: torch.Tensor):
        self.desc = f"{x.shape[0]}x{x.shape[1]}"
        percent = "%d|%s" % (x.shape[0], x.shape[1])  # noqa: UP031 - the %-format path
        return x + 1, f"rows={x.shape[0]}", str(tuple(x.shape)), str(x.shape), percent


def test_text_of_sizes_is_eagers() -> None:
    model = Describes()
    compiled = stampout.compile(model, backend="eager")
    for n in (2, 5, 7, 5):
        x = torch.ones(n, 3)
        got, got_desc = compiled(x), model.desc
        expected, expected_desc = model(x), model.desc
        assert got[1:] == expected[1:] and got_desc == expected_desc
        torch.testing.assert_close(got[0], expected[0])


def formats(x: torch.Tensor):
    q, r = divmod(x.shape[0], 4)
    padded = "{:03d}".format(x.shape[0])  # noqa: UP032 - str.format's path
    return (x[: q + r] * 2, padded, f"{x.shape[0] / 2}|{x.shape[0] > 3}|{x.shape[0]:>4}", x.shape[0].bit_length(),
            json.dumps({"n": x.shape[0]}))


def test_formats_and_divmod_of_sizes() -> None:
    compiled = stampout.compile(formats, backend="eager")
    for n in (2, 5, 9):
        x = torch.ones(n)
        got, expected = compiled(x), formats(x)
        assert got[1:] == expected[1:]
        torch.testing.assert_close(got[0], expected[0])


class Config:
    def __init__(self) -> None:
        self.step = 1

    def __index__(self) -> int:
        return self.step

    def __bool__(self) -> bool:
        return self.step > 2  # a SymBool where step is a symbol: Python refuses it


def test_changing_int_attribute_in_text_and_index() -> None:
    config, log = Config(), []

    def program(x: torch.Tensor):
        log.append(f"step {config.step}")
        return x * config.step, f"n={config.step}"

    def indexed(x: torch.Tensor) -> torch.Tensor:
        return x * [10, 20, 30, 40][config] + (1 if config else 0)  # Config.__index__ returns config.step

    compiled, compiled_indexed = stampout.compile(program, backend="eager"), stampout.compile(indexed, backend="eager")
    for step in (1, 2, 3, 2):
        config.step = step
        got = compiled(torch.ones(1))
        got_log = log[-1]
        expected = program(torch.ones(1))
        assert (got[1], got_log) == (expected[1], log[-1])
        torch.testing.assert_close(got[0], expected[0])
        torch.testing.assert_close(compiled_indexed(torch.ones(1)), indexed(torch.ones(1)))


def test_symbolic_capture_kept_where_text_is_not_user_code() -> None:
    """A size in a `torch._check_tensor_all` message (stampout makes the assert's text, not the program) does not
    specialize the capture."""

    def checked(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        torch._check_tensor_all(x > 0, lambda: f"not positive, of {n}")
        return x * 2

    compiled = stampout.compile(checked, backend="eager")
    for n in (2, 5, 7, 9):
        torch.testing.assert_close(compiled(torch.ones(n)), checked(torch.ones(n)))
    assert compiled.stats.captures == 2  # static, then one symbolic capture for every later size


def test_other_threads_see_the_symbol() -> None:
    """The text is eager's on the capturing thread only; another thread meanwhile sees SymInt's own repr, and after
    the capture the class is as torch made it. (The other thread runs beside the call: a thread started in the
    traced code makes it run eagerly, regions/purity.)"""
    seen, box = {}, {}
    original = torch.SymInt.__repr__

    def watcher() -> None:
        while "n" not in box:
            time.sleep(0.001)
        seen["other"] = repr(box["n"])

    def program(x: torch.Tensor):
        n = x.shape[0]
        if isinstance(n, torch.SymInt) and "n" not in box:
            box["n"] = n
            while "other" not in seen:  # (until the other thread has read it, during this capture)
                pass
            seen["here"] = repr(n)
        return x + 1

    compiled = stampout.compile(program, backend="eager")
    compiled(torch.ones(2))
    worker = threading.Thread(target=watcher, daemon=True)
    worker.start()
    compiled(torch.ones(3))
    worker.join(timeout=60)
    assert seen["here"] == "3" and seen["other"] != "3"
    assert torch.SymInt.__repr__ is original and "__format__" not in vars(torch.SymInt)
