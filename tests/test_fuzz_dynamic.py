"""Fuzzing symbolic sizes: random programs that compute with the sequence length (slices, concatenations,
branches, reshapes, arange, int() conversions, sizes passed into regions) run under
`compile(dynamic=None|True|False)` over random lengths; every call must equal eager, and no capture may serve
a length its assumptions do not cover (the values would differ)."""

from __future__ import annotations

import copy

import torch
from fuzzing import examples
from helpers import tree_assert_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import stampout

D = 8
STEPS = ("narrow", "cat_tail", "arange", "branch", "reshape", "roll", "center", "int_half", "sized_region",
         "pad_to_multiple", "flip_if_even")


class Step(nn.Module):
    def __init__(self, kind: str, k: int) -> None:
        super().__init__()
        self.kind, self.k = kind, k
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        k = self.k
        x = self.fc(x)
        if self.kind == "narrow":
            return x.narrow(1, 0, t // (k + 1) + 1)
        if self.kind == "cat_tail":
            return torch.cat([x, x[:, t - (t % k) - 1 :]], dim=1)
        if self.kind == "arange":
            return x * torch.arange(t, dtype=x.dtype).view(1, t, 1) / t
        if self.kind == "branch":
            return x * 2 if t > 3 * k else x - 1
        if self.kind == "reshape":
            return x.reshape(b, t * d // 2, 2).transpose(1, 2).reshape(b, t, d)
        if self.kind == "roll":
            return torch.roll(x, shifts=t // k, dims=1)
        if self.kind == "center":
            return x - x.mean(1, keepdim=True)
        if self.kind == "int_half":
            return x[:, : int(t) // 2 + 1] + float(t % k)
        if self.kind == "sized_region":
            return scaled(x, t // k + 1)
        if self.kind == "pad_to_multiple":
            return nn.functional.pad(x, (0, 0, 0, (-t) % k))
        if t % 2 == 0:  # flip_if_even
            return x.flip(1)
        return x


@stampout.region
def scaled(x: torch.Tensor, n: int) -> torch.Tensor:
    return x[:, :n] * n


class Program(nn.Module):
    def __init__(self, steps: list[tuple[str, int]], repeat: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(*(Step(kind, k) for kind, k in steps)) for _ in range(repeat))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        for block in self.blocks:
            x = block(x)
        return x, x.shape[1]


@settings(max_examples=examples(30), deadline=None, suppress_health_check=list(HealthCheck))
@given(
    steps=st.lists(st.tuples(st.sampled_from(STEPS), st.integers(1, 4)), min_size=1, max_size=4),
    repeat=st.integers(1, 3),
    lengths=st.lists(st.integers(2, 24), min_size=2, max_size=6),
    dynamic=st.sampled_from([None, True, False]),
    auto=st.booleans(),
)
def test_random_size_programs_equal_eager(steps, repeat, lengths, dynamic, auto):
    model = Program(steps, repeat)
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager", dynamic=dynamic, regions="auto" if auto else None)
    for i, t in enumerate(lengths):
        x = torch.randn(2, t, D, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            tree_assert_close(fn(x), reference(x))
    assert fn.stats.captures <= len(lengths)
    if dynamic is False:
        assert fn.stats.captures == len(set(lengths))


def test_a_region_traced_with_symbolic_sizes_in_another_capture_is_not_bound_to_this_ones_symbols():
    """Found by the fuzzer above: the second block's region was traced in an earlier symbolic capture, taking its
    input length as the symbol `s27`; the capture at length 15 (the pad specializes it) named its own input length
    `s27` too, and the stamped call passed 15 for a block input of length 16 (a size mismatch at run time)."""
    model = Program([("arange", 1), ("pad_to_multiple", 2)], repeat=2)
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager", dynamic=None, regions="auto")
    for i, t in enumerate([11, 16, 13, 24, 11, 15]):
        x = torch.randn(2, t, D, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            tree_assert_close(fn(x), reference(x))
    assert fn.stats.captures == 5
