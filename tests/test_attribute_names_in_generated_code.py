"""Attribute names that Python reads differently in source than getattr/setattr take them.

The guard predicate and the replay of stores are generated Python. An identifier such as "s\ufb01" (the ligature fi)
is valid, but the compiler normalises it (NFKC): `c.s\ufb01` in source is `c.sfi`, while `getattr(c, "s\ufb01")`
is the attribute the program read. Such names must go through getattr/setattr in generated code."""

from __future__ import annotations

import torch

import stampout

LIGATURE = "\ufb01"  # 'fi' as one character: an identifier, not NFKC-normal


class Box:
    pass


class Holder:
    pass


def test_a_guard_on_an_attribute_with_a_non_ascii_name_reads_that_attribute():
    def f(x, c):
        return x * getattr(c, "s" + LIGATURE)

    c = Box()
    setattr(c, "s" + LIGATURE, 2)
    c.sfi = 2  # what the normalised name would read: it never changes
    compiled = stampout.compile(f, backend="eager")
    for value in (2, 2, 5, 7):
        setattr(c, "s" + LIGATURE, value)
        assert compiled(torch.ones(2), c).tolist() == f(torch.ones(2), c).tolist() == [float(value)] * 2


def test_replayed_stores_use_the_attribute_name_the_program_used():
    def f(x, c):
        y = x * 2
        setattr(c, LIGATURE, y)
        getattr(c, "h" + LIGATURE).t = y + 1
        return y + 1

    def world():
        c = Box()
        setattr(c, "h" + LIGATURE, Holder())
        c.hfi = Holder()
        return c

    def state(c):
        return sorted(vars(c)), sorted(vars(c.hfi)), sorted(vars(getattr(c, "h" + LIGATURE)))

    compiled = stampout.compile(f, backend="aot_eager")
    for i in range(3):
        mine, theirs = world(), world()
        out, expected = compiled(torch.ones(2) * i, mine), f(torch.ones(2) * i, theirs)
        torch.testing.assert_close(out, expected)
        assert state(mine) == state(theirs)
        torch.testing.assert_close(getattr(mine, "h" + LIGATURE).t, getattr(theirs, "h" + LIGATURE).t)
    assert compiled.stats.captures == 1
