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
