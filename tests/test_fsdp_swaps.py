"""FSDP2's parameter swaps (fsdp_swaps.py): written without bumping the epoch, checked per call by identity.

The swap function is the one stampout routes FSDP's `unsafe_setattr_param` through; these tests call it
directly on plain modules (no process group), then a one-rank FSDP model shows a steady step bumps nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import stampout
from stampout.compile import entries as compiled_entries
from stampout.compile import fsdp_swaps
from stampout.watch.tracking import EPOCH


def _fsdp_swap():
    return fsdp_swaps._swapping(lambda m, n, p: setattr(m, n, p))


def _refreshes(monkeypatch) -> list[int]:
    calls: list[int] = []
    refresh = compiled_entries.Entry.refresh

    def counted(self, ctx):
        calls.append(1)
        return refresh(self, ctx)

    monkeypatch.setattr(compiled_entries.Entry, "refresh", counted)
    return calls


def test_a_swapped_parameter_is_read_per_call(monkeypatch):
    """A parameter swapped for another of the same metadata: the next call computes with (and
    differentiates into) the new one, though no write moved the epoch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    fn = stampout.compile(model, backend="eager")
    swap = _fsdp_swap()
    x = torch.randn(2, 4)
    swap(model[0], "weight", model[0].weight)  # (its first swap registers the parameter, and bumps)
    torch.testing.assert_close(fn(x), model(x))
    other = nn.Parameter(torch.randn(4, 4))
    refreshes = _refreshes(monkeypatch)
    before = EPOCH.value
    swap(model[0], "weight", other)
    assert EPOCH.value == before and model[0].weight is other
    out = fn(x)
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    assert other.grad is not None
    assert refreshes == [1]  # the module held another object: the full check ran again, once
    fn(x)
    assert refreshes == [1]  # then the per-call check holds again


def test_a_swapped_parameter_of_other_metadata_is_not_reused():
    """A swapped-in parameter that does not require grad: the capture made for one that did is not reused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    fn = stampout.compile(model, backend="eager")
    swap = _fsdp_swap()
    x = torch.randn(2, 4)
    swap(model[0], "weight", model[0].weight)
    fn(x)
    swap(model[0], "weight", nn.Parameter(torch.randn(4, 4), requires_grad=False))
    torch.testing.assert_close(fn(x), model(x))
    assert fn.stats.captures == 2


@pytest.mark.parametrize("how", ["setattr", "registry", "load_state_dict"])
def test_other_writes_to_a_swapped_parameter_still_bump(how):
    """Only FSDP's own swaps are quiet: the user's writes to the same parameter invalidate as before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    ref = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager")
    _fsdp_swap()(model[0], "weight", model[0].weight)
    x = torch.randn(2, 4)
    fn(x)
    before = EPOCH.value
    new = nn.Parameter(torch.randn(4, 4))
    if how == "setattr":
        model[0].weight = new
    elif how == "registry":
        model[0]._parameters["weight"] = new
    else:
        model.load_state_dict({"0.weight": new.detach(), "0.bias": ref[0].bias.detach()}, assign=True)
    assert EPOCH.value != before
    with torch.no_grad():
        ref[0].weight.copy_(new)
    torch.testing.assert_close(fn(x), ref(x))


def test_a_capture_sees_fsdp_writes_as_before():
    """Inside a capture FSDP's function runs as it was (the write goes through the module's watchers)."""
    calls = []
    swap = fsdp_swaps._swapping(lambda m, n, p: calls.append(n))

    class Swapping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            swap(self.lin, "weight", self.lin.weight)
            return self.lin(x)

    model = Swapping()
    stampout.capture(model, torch.randn(2, 4))
    assert calls == ["weight"]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")
def test_fsdp_steady_step_runs_no_full_check(tmp_path, monkeypatch):
    """One gloo rank, FSDP2 blocks and root: after the first steps, a training step moves no epoch and
    refreshes no entry (each piece runs its per-call check only), with eager's gradients."""
    import datetime as dt

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=dt.timedelta(seconds=60))
    try:
        def make():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
            for layer in (model[0], model[2], model):
                fully_shard(layer)
            return model

        model, ref = make(), make()
        fn = stampout.compile(model, backend="eager")
        x = torch.randn(3, 8)
        for _ in range(2):
            fn(x).pow(2).sum().backward()
            ref(x).pow(2).sum().backward()
        refreshes = _refreshes(monkeypatch)
        before = EPOCH.value
        fn(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        assert EPOCH.value == before and refreshes == []
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor())
    finally:
        dist.destroy_process_group()
