"""Third red-team round: ordinary programs that were wrong or crashed, each now equal to eager (or run eagerly
with a warning that names why)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import stampout


def _store_model() -> tuple[type[nn.Module], list]:
    store: list = []

    class Appender(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            store.append(x.shape[0])
            store.append(self.lin(x).detach().sum())
            return self.lin(x)

    Appender.store = store  # the same list, by a second path (a class attribute)
    return Appender, store


@pytest.mark.parametrize("dynamic", [True, False])
def test_a_list_reached_by_two_paths_is_appended_to_once(dynamic):
    cls, store = _store_model()
    torch.manual_seed(0)
    model = cls()
    fn = stampout.compile(copy.deepcopy(model), backend="eager", dynamic=dynamic)
    xs = [torch.randn(n, 4) for n in (2, 3, 5)]
    for x in xs:
        fn(x)
    got = list(store)
    store.clear()
    for x in xs:
        model(x)
    assert [v if isinstance(v, int) else round(float(v), 4) for v in got] == \
        [v if isinstance(v, int) else round(float(v), 4) for v in store]


class IdBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if (id(x) >> 4) % 2 else self.b(x)


def test_a_decision_on_id_is_not_baked(caplog):
    torch.manual_seed(0)
    model = IdBranch()
    fn = stampout.compile(model, backend="eager")
    with caplog.at_level(logging.WARNING, logger="stampout"):
        for _ in range(12):
            x = torch.randn(2, 4)
            torch.testing.assert_close(fn(x), model(x))
    assert any("builtins.id" in r.getMessage() for r in caplog.records)


class LazyBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "running"):
            self.register_buffer("running", torch.zeros(4))
        self.running.add_(x.mean(0))
        return self.lin(x) + self.running


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_buffer_registered_in_forward_is_real_and_kept(backend):
    torch.manual_seed(0)
    model = LazyBuffer()
    compiled_model = copy.deepcopy(model)
    fn = stampout.compile(compiled_model, backend=backend)
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(fn(x), model(x))
        assert type(compiled_model.running) is torch.Tensor
        torch.testing.assert_close(compiled_model.running, model.running)
    assert fn.stats.captures == 2  # (the first call registered it; the second reads it as a buffer)
    assert list(compiled_model.state_dict()) == list(model.state_dict())
