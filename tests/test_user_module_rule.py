"""One definition of a user module (regions.code.is_user_module), asked by the guards on a module used as a value
and by the world snapshot that remembers what a module's namespace held before a capture. A builtin module (`sys`,
`itertools`: no file, but imported) is not user code for either; a module made with `types.ModuleType` is."""

from __future__ import annotations

import itertools
import sys
import types

import torch

import stampout
from stampout.regions.code import is_user_module
from stampout.world_snapshot import Snapshot

MADE = types.ModuleType("made_config")  # (no file, no spec: made by code)
MADE.SCALE = 2.0


def test_which_modules_are_user_code():
    assert is_user_module(MADE)
    assert not is_user_module(sys) and not is_user_module(itertools) and not is_user_module(torch)
    assert not is_user_module(None)


def test_the_world_snapshot_keeps_the_namespace_of_user_modules_only():
    # world.py had its own test, which took every module without a file for user code: each capture that ran
    # code naming `sys` or `itertools` copied (and after it, scanned) their namespaces as if they were a user's.
    snapshot = Snapshot()
    for module in (sys, itertools, MADE):
        snapshot.note(module, 1)
    noted = {id(container) for container, _ in snapshot.containers.values()}
    assert id(MADE.__dict__) in noted
    assert id(sys.__dict__) not in noted and id(itertools.__dict__) not in noted


def _reads_the_made_module(x, name="SCALE"):
    return x * getattr(MADE, name)  # (a module used as a value: every name in it is guarded)


def test_a_user_module_read_as_a_value_is_guarded():
    compiled = stampout.compile(_reads_the_made_module, backend="eager")
    x = torch.ones(2)
    torch.testing.assert_close(compiled(x), x * 2)
    MADE.SCALE = 3.0
    try:
        torch.testing.assert_close(compiled(x), x * 3)
    finally:
        MADE.SCALE = 2.0
