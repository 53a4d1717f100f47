"""Objects many modules hold (a config shared by every layer) are walked once after a capture, and still left
without traced values (SPEC §3, "the world is left as eager leaves it"): a fake that a region computed (not an
output the graph can make real) written behind `__setattr__` on a shared object, on one of two look-alike
objects, or on an object one level inside, is taken out."""

from __future__ import annotations

import functools

import torch
from blocks import RegionStack
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import stampout


class Inner:
    def __init__(self) -> None:
        self.scale = 2.0

    @functools.cached_property
    def table(self) -> torch.Tensor:  # (stored in the instance's __dict__, behind __setattr__)
        return torch.arange(8.0) * self.scale


class Config:
    def __init__(self) -> None:
        self.eps = 1e-5
        self.inner = Inner()

    @functools.cached_property
    def table(self) -> torch.Tensor:
        return torch.arange(8.0) + self.eps


class Layer(nn.Module):
    def __init__(self, cfg: Config, where: str | None) -> None:
        super().__init__()
        self.cfg = cfg
        self.lin = nn.Linear(8, 8)
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * self.cfg.inner.scale + self.cfg.eps
        if self.where == "cfg":  # (a tensor computed inside the region, kept where the graph cannot make it real)
            h = h + self.cfg.table
        elif self.where == "inner":
            h = h + self.cfg.inner.table
        return h


class Stack(RegionStack):
    def __init__(self, configs: list[Config], where: list[str | None]) -> None:
        super().__init__(Layer(c, w) for c, w in zip(configs, where))


def _fakes_in(obj: object) -> list[str]:
    return [k for k, v in vars(obj).items() if isinstance(v, FakeTensor)]


def _captured(model: nn.Module) -> None:
    x = torch.randn(2, 8)
    expected = model(x)
    for obj in {id(layer.cfg): layer.cfg for layer in model.layers}.values():  # eager cached real ones: drop them
        obj.__dict__.pop("table", None)
        obj.inner.__dict__.pop("table", None)
    cap = stampout.capture(model, x)
    torch.testing.assert_close(cap(x), expected)
    assert cap.stats.traces >= 1


def test_a_config_every_layer_holds_is_left_clean() -> None:
    cfg = Config()
    model = Stack([cfg] * 4, [None, None, None, "cfg"])
    _captured(model)
    assert _fakes_in(cfg) == [] and _fakes_in(cfg.inner) == []


def test_the_second_of_two_look_alike_configs_is_cleaned_too() -> None:
    clean, written = Config(), Config()
    model = Stack([clean, clean, written, written], [None, None, None, "cfg"])
    _captured(model)
    assert _fakes_in(clean) == [] and _fakes_in(written) == []


def test_an_object_inside_a_shared_config_is_cleaned() -> None:
    cfg = Config()
    model = Stack([cfg] * 3, [None, None, "inner"])
    _captured(model)
    assert _fakes_in(cfg.inner) == []


class Kept(Layer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        if self.where == "lin":  # (behind __setattr__ on a submodule the bound forward's layer reaches)
            self.lin.__dict__["last"] = h * 2
        return h


def test_layer_20_of_32_leaves_a_fake_in_the_shared_config_or_a_submodule_and_it_is_taken_out() -> None:
    """The repair walks what a config and a bound `forward` reach once per pass (clean objects): a layer after the
    walked ones that left a traced value is still found, traced again rather than stamped."""
    for where in ("cfg", "inner", "lin"):
        cfg = Config()
        model = Stack([cfg] * 32, [where if i == 20 else None for i in range(32)])
        if where == "lin":
            for layer in model.layers:
                layer.__class__ = Kept
                layer.forward = stampout.region(Kept.forward.__get__(layer))
        x = torch.randn(2, 8)
        expected = model(x)
        last = model.layers[20].lin.__dict__.get("last")
        for obj in (cfg, cfg.inner, model.layers[20].lin):
            obj.__dict__.pop("table", None)
            obj.__dict__.pop("last", None)
        cap = stampout.capture(model, x)
        torch.testing.assert_close(cap(x), expected)
        assert (cap.stats.traces, cap.stats.reuses) == (2, 30), (where, cap.stats)
        assert _fakes_in(cfg) == [] and _fakes_in(cfg.inner) == [], where
        assert all(_fakes_in(layer.lin) == [] for layer in model.layers), where
        if where == "lin":  # (the left-over pass found it: stored real, as eager leaves it)
            torch.testing.assert_close(model.layers[20].lin.last, last)
