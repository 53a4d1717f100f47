"""Stacks where one layer differs: the odd layer must be traced again, and results must equal eager.

Includes a hypothesis property test: random perturbations of random layers never change the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from fuzzing import examples
from helpers import assert_matches_eager
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import stampout

ACTS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


@dataclass
class LayerConfig:
    act: str = "silu"


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(var + self.eps)


class TrainFlag(nn.Module):
    """Doubles in training, identity in eval: a deterministic stand-in for dropout."""

    def forward(self, x):
        return x * 2 if self.training else x


class Layer(nn.Module):
    def __init__(self, cfg: LayerConfig, d: int = 8, hidden: int = 16):
        super().__init__()
        self.cfg = cfg
        self.norm = RMSNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.flag = TrainFlag()
        self.scale = 1.0

    @stampout.region
    def forward(self, x):
        h = self.norm(x).to(self.up.weight.dtype)
        h = self.down(ACTS[self.cfg.act](self.up(h)))
        return x + self.flag(h).to(x.dtype) * self.scale


class Stack(nn.Module):
    def __init__(self, n: int = 4, d: int = 8):
        super().__init__()
        self.cfg = LayerConfig()
        self.embed = nn.Linear(d, d)
        self.layers = nn.ModuleList([Layer(self.cfg, d) for _ in range(n)])

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def check(model: nn.Module, traces: int, odd: int = 2) -> None:
    cap = assert_matches_eager(model, torch.randn(3, 8), grad=True)
    assert cap.stats.traces + cap.stats.dedups == traces, cap.explain()
    assert cap.events[odd].outcome in ("traced", "deduped"), cap.explain()
    assert all(e.outcome == "reused" for i, e in enumerate(cap.events) if i not in (0, odd)), cap.explain()


def test_uniform_stack_traces_once():
    cap = assert_matches_eager(Stack(4), torch.randn(3, 8), grad=True)
    assert (cap.stats.traces, cap.stats.reuses, cap.stats.subgraphs) == (1, 3, 1)


def test_one_layer_with_different_eps():
    model = Stack(4)
    model.layers[2].norm.eps = 1e-2
    check(model, traces=2)  # layer 3 matches layer 0's entry again


def test_one_layer_with_its_own_config_object():
    model = Stack(4)
    model.layers[2].cfg = LayerConfig(act="gelu")
    check(model, traces=2)


def test_shared_config_object_equal_fields_still_reuses():
    model = Stack(4)
    model.layers[2].cfg = LayerConfig(act="silu")  # another object, same fields
    cap = assert_matches_eager(model, torch.randn(3, 8), grad=True)
    assert cap.stats.traces == 1


def test_forward_hook_on_one_layer_submodule():
    model = Stack(4)
    model.layers[2].up.register_forward_hook(lambda mod, inp, out: out * 3)
    check(model, traces=2)


def test_pre_hook_on_one_layer():
    model = Stack(4)
    model.layers[2].norm.register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,))
    check(model, traces=2)


def test_one_layer_in_eval_mode_while_others_train():
    model = Stack(4).train()
    model.layers[2].eval()
    check(model, traces=2)


def test_one_layer_in_a_different_dtype():
    model = Stack(4)
    model.layers[2].to(torch.float64)
    check(model, traces=2)


def test_one_layer_with_a_different_hidden_size():
    model = Stack(4)
    model.layers[2] = Layer(model.cfg, 8, hidden=32)
    check(model, traces=2)


def test_one_layer_with_a_different_scale_type():
    model = Stack(4)
    model.layers[2].scale = 1  # int, not float: a different constant
    check(model, traces=2)


def test_one_layer_with_a_replaced_activation_module():
    model = Stack(4)
    model.layers[2].flag = nn.Identity()
    check(model, traces=2)


def test_one_layer_frozen():
    model = Stack(4)
    model.layers[2].requires_grad_(False)
    check(model, traces=2)


# ---- property test ----------------------------------------------------------------------------------
def _perturb(layer: Layer, kind: int, model: Stack) -> None:
    if kind == 0:
        layer.norm.eps = 1e-3
    elif kind == 1:
        layer.cfg = LayerConfig(act="relu")
    elif kind == 2:
        layer.up.register_forward_hook(lambda mod, inp, out: out + 1)
    elif kind == 3:
        layer.eval()
    elif kind == 4:
        layer.to(torch.float64)
    elif kind == 5:
        layer.scale = 0.5
    elif kind == 6:
        layer.flag = nn.Tanh()
    elif kind == 7:
        layer.requires_grad_(False)
    elif kind == 8:
        with torch.no_grad():
            layer.up.weight.mul_(2)  # values only: must still reuse, and use this layer's weights
    elif kind == 9:
        model.cfg.act = "gelu"  # the shared config: every layer changes


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(2, 5),
    changes=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 9)), max_size=4),
    train=st.booleans(),
)
def test_random_perturbations_never_change_results(n, changes, train):
    torch.manual_seed(0)
    model = Stack(n).train(train)
    for index, kind in changes:
        _perturb(model.layers[index % n], kind, model)
    cap = assert_matches_eager(model, torch.randn(3, 8), grad=True)
    touched = {index % n for index, _ in changes}
    # every layer no perturbation touched is stamped from the first untouched one's trace
    untouched = n - len(touched)
    assert cap.stats.reuses >= untouched - 1, cap.explain()
    if not changes:
        assert (cap.stats.traces, cap.stats.reuses, cap.stats.subgraphs) == (1, n - 1, 1)
