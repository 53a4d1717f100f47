"""State the program hands to C code whole is guarded like state it reads: `copy.copy`, `copy.deepcopy` and
pickling read an object's `__dict__` through `object.__reduce_ex__`, no attribute read in Python (SPEC §4:
reuse only on what is proven)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import stampout


class Config:
    def __init__(self, scale: float) -> None:
        self.scale = scale


COPIES = {
    "copy.copy": copy.copy,
    "pickle": lambda c: pickle.loads(pickle.dumps(c)),
}


class CopiesConfig(nn.Module):
    def __init__(self, cfg: Config, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cfg = cfg
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = COPIES[self.how](self.cfg)
        return self.lin(x) * local.scale


@pytest.mark.parametrize("how", list(COPIES))
def test_a_field_copied_by_c_code_is_guarded(how):
    torch.manual_seed(0)
    model, x = CopiesConfig(Config(2.0), how), torch.randn(2, 4)
    fn = stampout.compile(model, backend="eager")
    for scale in (2.0, 2.0, 7.0, 7.0):
        model.cfg.scale = scale
        torch.testing.assert_close(fn(x), model(x))
    assert fn.stats.captures == 2


@pytest.mark.parametrize("how", list(COPIES))
def test_a_region_copying_a_config_is_reused_only_for_equal_fields(how):
    torch.manual_seed(0)
    model = nn.Sequential(*[CopiesConfig(Config(s), how) for s in (2.0, 2.0, 3.0)])
    x = torch.randn(2, 4)
    with stampout.auto_regions(model):
        cap = stampout.capture(model, x)
    torch.testing.assert_close(cap(x), model(x))
    assert (cap.stats.traces, cap.stats.reuses) == (2, 1)


class WithDefault(dict):
    """A dict whose missing keys read an attribute: C's `dict[key]` calls `__missing__`, no read in the caller."""

    def __init__(self, default: float) -> None:
        super().__init__()
        self.default = default

    def __missing__(self, key: str) -> float:
        return self.default


class ClassDefault(dict):
    fallback = 1.0

    def __missing__(self, key: str) -> float:
        return _class_default(self)


def _class_default(table: dict) -> float:
    return type(table).fallback


def _scaled(x: torch.Tensor, table: dict) -> torch.Tensor:
    return x * table["scale"]


class TableModule(nn.Module):
    def __init__(self, table: dict) -> None:
        super().__init__()
        self.table = table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scaled(x, self.table)


def _change(table: dict) -> None:
    if isinstance(table, WithDefault):
        table.default = 9.0
    else:
        ClassDefault.fallback = 9.0


@pytest.mark.parametrize("held", ["argument", "attribute"])
@pytest.mark.parametrize("kind", [WithDefault, ClassDefault])
def test_a_dict_subclass_read_by_missing_is_guarded(kind, held):
    table, x = kind(2.0) if kind is WithDefault else kind(), torch.randn(3)
    program = _scaled if held == "argument" else TableModule(table)
    args = (x, table) if held == "argument" else (x,)
    fn = stampout.compile(program, backend="eager")
    try:
        for _ in range(2):
            torch.testing.assert_close(fn(*args), program(*args))
        _change(table)
        for _ in range(2):
            torch.testing.assert_close(fn(*args), program(*args))
    finally:
        ClassDefault.fallback = 1.0
    if kind is ClassDefault or held == "attribute":  # (guarded: one capture per value)
        assert fn.stats.captures == 2


def test_a_region_taking_a_dict_subclass_with_attributes_is_not_reused():
    # (an argument opened into its items: no guard reads its attributes, so its traces are not reused)
    block = stampout.region(_scaled)

    def program(x, a, b, c):
        return block(block(block(x, a), b), c)

    tables, x = [WithDefault(2.0), WithDefault(2.0), WithDefault(3.0)], torch.randn(3)
    cap = stampout.capture(program, x, *tables)
    torch.testing.assert_close(cap(x, *tables), program(x, *tables))
    assert cap.stats.reuses == 0
