"""One definition of a user module (trace.code.is_user_module), asked by the guards on a module used as a value
and by the world snapshot that remembers what a module's namespace held before a capture. A builtin module (`sys`,
`itertools`: no file, but imported) is not user code for either; a module made with `types.ModuleType` is."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import itertools
import sys
import types

import pytest
import torch
from torch import nn

import stampout
from stampout.trace.code import is_user_module
from stampout.watch.world_snapshot import Snapshot

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


def _spec_module(name: str) -> types.ModuleType:
    """A module with a spec but no file, as `importlib.util.module_from_spec` makes for a loader-less spec."""
    return importlib.util.module_from_spec(importlib.machinery.ModuleSpec(name, None))


def _namespace_package(tmp_path, name: str) -> types.ModuleType:
    """A user's namespace package (a folder without `__init__.py`): `__file__` None, `__spec__` set."""
    (tmp_path / name).mkdir()
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))


def test_a_namespace_package_read_as_a_value_is_guarded(tmp_path):
    cfg = _namespace_package(tmp_path, "rt_ns_cfg_read")
    cfg.SCALE = 2.0
    try:
        def f(x, name="SCALE"):
            return x * getattr(cfg, name)

        compiled = stampout.compile(f, backend="eager")
        x = torch.ones(3)
        torch.testing.assert_close(compiled(x), f(x))
        cfg.SCALE = 5.0
        torch.testing.assert_close(compiled(x), f(x))  # got x * 2: the capture's SCALE, baked
    finally:
        sys.modules.pop("rt_ns_cfg_read", None)


def test_a_spec_module_held_by_a_module_is_guarded():
    cfg = _spec_module("rt_spec_cfg")
    cfg.SCALE = 2.0

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cfg = cfg
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x) * self.cfg.SCALE

    model = M()
    compiled = stampout.compile(model, backend="eager")
    x = torch.ones(2, 3)
    torch.testing.assert_close(compiled(x), model(x))
    cfg.SCALE = 7.0
    torch.testing.assert_close(compiled(x), model(x))  # got the result for SCALE 2.0


def test_a_region_storing_into_a_namespace_package_leaves_a_real_tensor(tmp_path):
    cfg = _namespace_package(tmp_path, "rt_ns_cfg_store")
    cfg.last = None
    try:
        class Layer(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(3, 3)

            def forward(self, x):
                h = self.lin(x)
                cfg.last = h
                return h

        model = nn.Sequential(Layer(), Layer())
        out = stampout.compile(model, backend="eager", regions="auto")(torch.ones(2, 3))
        assert type(cfg.last) is torch.Tensor, type(cfg.last)  # was a FakeTensor from the capture
        torch.testing.assert_close(cfg.last, out)
    finally:
        sys.modules.pop("rt_ns_cfg_store", None)


D = 4


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, D, generator=torch.Generator().manual_seed(seed))


CONFIG = types.ModuleType("stampout_round4_config")  # a config module (made here; a user file's works the same)


HOLDERS = [CONFIG]


NAME = "SCALE"


def _config():
    return CONFIG


READS = {
    "attribute of self": lambda self: self.config.SCALE,
    "item of a list": lambda self: HOLDERS[0].SCALE,
    "getattr": lambda self: getattr(CONFIG, NAME),
    "vars": lambda self: vars(CONFIG)["SCALE"],
    "returned by a function": lambda self: _config().SCALE,
}


class ReadsConfig(nn.Module):
    def __init__(self, read) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.config = CONFIG
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.read(self)


@pytest.mark.parametrize("how", list(READS))
def test_a_config_module_read_as_a_value_is_guarded(how):
    CONFIG.SCALE = 1.0
    torch.manual_seed(0)
    model = ReadsConfig(READS[how])
    fn = stampout.compile(model, backend="eager")
    x = _x()
    torch.testing.assert_close(fn(x), model(x))
    CONFIG.SCALE = 3.0
    try:
        torch.testing.assert_close(fn(x), model(x))
        assert fn.stats.captures == 2
    finally:
        CONFIG.SCALE = 1.0


def test_library_modules_read_as_values_keep_reuse():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.act = "tanh"

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return getattr(torch, self.act)(self.lin(x))

    model = nn.Sequential(Block(), Block(), Block())
    with stampout.auto_regions(model):
        cap = stampout.capture(model, _x())
    assert cap.stats.traces == 1
