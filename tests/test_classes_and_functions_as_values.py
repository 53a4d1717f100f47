"""A user class reached as a value (passed, or read from a global: `cfg.scale` on the class object itself) and a
user function's own attributes (`helper.k`) are state the program reads with no watch to see it: what the class
defines (class attributes, staticmethods, classmethods, a metaclass's properties) and what the function holds are
guarded, so a change between calls is seen; a function attribute the program stores is stored again each call."""

from __future__ import annotations

import pytest
import torch

import stampout


class Config:
    scale = 2.0

    @staticmethod
    def act(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)

    @classmethod
    def offset(cls) -> float:
        return cls.scale * 3


class Meta(type):
    @property
    def shift(cls) -> float:
        return cls._shift


class Shifted(metaclass=Meta):
    _shift = 1.0


CONFIG = Config


def _passed(x: torch.Tensor, cfg: type) -> torch.Tensor:
    return cfg.act(x) * cfg.scale + cfg.offset()


def _global(x: torch.Tensor) -> torch.Tensor:
    return CONFIG.act(x) * CONFIG.scale + CONFIG.offset() + Shifted.shift


def helper(x: torch.Tensor) -> torch.Tensor:
    return x * getattr(helper, "k", 1.0)


def _uses_helper(x: torch.Tensor) -> torch.Tensor:
    return helper(x) + 1


def log() -> None:
    pass


def _logs(x: torch.Tensor) -> torch.Tensor:
    log.last = x.shape[0] * 2
    return x + 1


CHANGES = [
    ("class attribute", lambda: setattr(Config, "scale", 5.0)),
    ("staticmethod", lambda: setattr(Config, "act", staticmethod(torch.tanh))),
    ("classmethod", lambda: setattr(Config, "offset", classmethod(lambda cls: cls.scale * 10))),
    ("metaclass property's data", lambda: setattr(Shifted, "_shift", 7.0)),
    ("metaclass property", lambda: setattr(Meta, "shift", property(lambda cls: 100.0))),
]


@pytest.fixture
def restored():
    saved = {k: v for k, v in vars(Config).items() if not k.startswith("__")}
    saved_meta, saved_shift = Meta.__dict__["shift"], Shifted._shift
    yield
    for k, v in saved.items():
        setattr(Config, k, v)
    Meta.shift, Shifted._shift = saved_meta, saved_shift
    vars(helper).pop("k", None)
    vars(log).pop("last", None)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("change", CHANGES, ids=[c[0] for c in CHANGES])
def test_what_a_class_reached_as_a_value_defines_is_guarded(restored, backend, change) -> None:
    passed, read = stampout.compile(_passed, backend=backend), stampout.compile(_global, backend=backend)
    x = torch.randn(4)
    for step in range(3):
        if step == 1:
            change[1]()
        torch.testing.assert_close(passed(x, Config), _passed(x, Config))
        torch.testing.assert_close(read(x), _global(x))
    assert read.stats.captures == 2  # (once more after the change, not on every call)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_functions_attribute_is_guarded(restored, backend) -> None:
    fn = stampout.compile(_uses_helper, backend=backend)
    x = torch.randn(4)
    for step in range(4):
        if step == 2:
            helper.k = 4.0
        torch.testing.assert_close(fn(x), _uses_helper(x))
    assert fn.stats.captures == 2


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_functions_attribute_stored_by_the_program_is_stored_each_call(restored, backend) -> None:
    fn = stampout.compile(_logs, backend=backend)
    for n in (3, 3, 3, 5):
        log.last = None
        fn(torch.ones(n))
        assert log.last == n * 2
