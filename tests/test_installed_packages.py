"""Code installed with pip is watched as a user's file (trace.code.is_user_file): a package in site-packages
keeps memo caches, registries and module globals as a user's module does, and a change to one between calls is
seen (the program is captured again or runs eagerly; its outputs are eager's). Only torch's own distribution and
the distributions it requires (sympy, jinja2, ...) count as library code.

The fake package lives in a temporary folder shaped like a venv, `lib/python3.11/site-packages/`, whose
`lib/python3.11/` is made a standard-library folder for the test, as a venv's `platstdlib` is (that folder holds
site-packages: a path that starts with it is not thereby the standard library's)."""

from __future__ import annotations

import importlib
import os
import sys
import textwrap

import pytest
import sympy
import torch
import transformers
from torch import nn

import stampout
from stampout.trace import code

_PACKAGE = '''
import collections
import contextvars
import os

import torch

SCALE = 2.0
REGISTRY = {"act": torch.relu}
_MEMO = {}
_MISSING = object()
GAIN = contextvars.ContextVar("gain", default=1.0)


class Instantiating(collections.OrderedDict):  # (as transformers' ACT2FN: a new module per item read)
    def __getitem__(self, key):
        cls, kwargs = super().__getitem__(key)
        return cls(**kwargs)


ACTIVATIONS = Instantiating({"gelu": (torch.nn.GELU, {}), "prelu": (torch.nn.PReLU, {})})


def install_scale_hook(module, factor):  # (as transformers' output capture installs its hooks: closures)
    def scale(mod, args, out):
        return out * factor

    module.register_forward_hook(scale)


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        assert len(ACTIVATIONS) == 2
        return self.lin(x) * SCALE * float(os.environ.get("FAKEPKG_GAIN", "1"))


def factor(n):
    found = _MEMO.get(n, _MISSING)
    if found is _MISSING:
        found = _MEMO[n] = SCALE * n
    return found


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    @staticmethod
    def act(x):
        return REGISTRY["act"](x)

    @property
    def width(self):
        return self.lin.in_features

    def forward(self, x):
        return self.act(self.lin(x)) * factor(self.width) * GAIN.get() + SCALE
'''


@pytest.fixture
def package(tmp_path, monkeypatch):
    stdlib = tmp_path / "lib" / "python3.11"
    site = stdlib / "site-packages"
    (site / "fakepkg").mkdir(parents=True)
    (site / "fakepkg" / "__init__.py").write_text(textwrap.dedent(_PACKAGE))
    monkeypatch.setattr(code, "_STDLIB_DIRS", (*code._STDLIB_DIRS, str(stdlib) + os.sep))
    monkeypatch.syspath_prepend(str(site))
    with stampout.config.patch(watch_installed=True):
        stampout.reset()
        yield importlib.import_module("fakepkg")
        sys.modules.pop("fakepkg", None)
    stampout.reset()


class _Stack(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([block() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _calls(package, regions, change):
    torch.manual_seed(0)
    model = _Stack(package.Block)
    compiled = stampout.compile(model, backend="eager", regions=regions)
    x = torch.randn(2, 4)
    for step in range(3):
        torch.testing.assert_close(compiled(x), model(x))
        change(package, step)
    torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.parametrize("regions", [None, "auto"])
def test_a_registry_entry_replaced_between_calls_is_seen(package, regions):
    def change(pkg, step):
        pkg.REGISTRY["act"] = (torch.tanh, torch.sigmoid, torch.relu)[step]

    _calls(package, regions, change)


@pytest.mark.parametrize("regions", [None, "auto"])
def test_a_module_global_changed_between_calls_is_seen(package, regions):
    def change(pkg, step):
        pkg.SCALE = 3.0 + step
        pkg._MEMO.clear()

    _calls(package, regions, change)


@pytest.mark.parametrize("regions", [None, "auto"])
def test_a_memo_cache_entry_changed_between_calls_is_seen(package, regions):
    def change(pkg, step):
        pkg._MEMO[4] = 10.0 + step  # (the memo now says something else for the same key)

    _calls(package, regions, change)


@pytest.mark.parametrize("regions", [None, "auto"])
def test_a_context_variable_set_between_calls_is_seen(package, regions):
    tokens = []

    def change(pkg, step):
        tokens.append(pkg.GAIN.set(2.0 + step))  # (a ContextVar the code reads: state it cannot guard, eager)

    try:
        _calls(package, regions, change)
    finally:
        for token in reversed(tokens):
            package.GAIN.reset(token)


@pytest.mark.parametrize("regions", [None, "auto"])
def test_a_dict_subclass_whose_items_are_made_per_read_is_read_as_stored(package, regions):
    """stampout's own walks and guards read a dict subclass's items as stored, never through its `__getitem__`
    (which made a PReLU with fake parameters per read while capturing: left in a module global, the program ran
    eagerly, and the layers traced per call)."""
    torch.manual_seed(0)
    model = _Stack(package.Plain)
    compiled = stampout.compile(model, backend="eager", regions=regions)
    x = torch.randn(2, 4)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), model(x))
    assert compiled.breaks == [] and compiled.stats.captures == 1
    assert compiled.stats.traces == (1 if regions else 0)


@pytest.mark.parametrize("regions", [None, "auto"])
def test_a_hook_closing_over_a_value_is_captured_and_its_cell_guarded(package, regions):
    torch.manual_seed(0)
    model = _Stack(package.Plain)
    package.install_scale_hook(model.layers[0].lin, 2.0)
    compiled = stampout.compile(model, backend="eager", regions=regions)
    x = torch.randn(2, 4)
    for _ in range(2):
        torch.testing.assert_close(compiled(x), model(x))
    assert compiled.breaks == [] and compiled.stats.captures == 1  # (was: a closure it cannot reach, eager)
    hook = next(iter(model.layers[0].lin._forward_hooks.values()))
    hook.__closure__[0].cell_contents = 3.0
    torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.parametrize("regions", [None, "auto"])
def test_the_environment_read_through_the_os_module_is_guarded_by_the_names_read(package, regions, monkeypatch):
    """`os.environ.get(name)` through the package's `os` global: the variable read is guarded, the rest of the
    environment is not (Inductor sets variables of its own while compiling: a guard on all of them captured a
    transformers Llama again on every generate call)."""
    torch.manual_seed(0)
    model = _Stack(package.Plain)
    compiled = stampout.compile(model, backend="eager", regions=regions)
    x = torch.randn(2, 4)
    torch.testing.assert_close(compiled(x), model(x))
    monkeypatch.setenv("STAMPOUT_TEST_UNRELATED", "1")
    torch.testing.assert_close(compiled(x), model(x))
    assert compiled.stats.captures == 1
    monkeypatch.setenv("FAKEPKG_GAIN", "3")
    torch.testing.assert_close(compiled(x), model(x))


def test_torch_and_what_it_requires_stay_library_code(package):
    import jinja2

    assert code.is_user_file(package.__file__)
    assert not code.is_user_file(torch.__file__) and not code.is_user_file(sympy.__file__)
    assert not code.is_user_file(jinja2.__file__)
    assert code.is_user_file(transformers.__file__)


def test_installed_packages_are_library_code_unless_watched(package):
    """`config.watch_installed` (STAMPOUT_WATCH_INSTALLED=1) decides; off, a venv's site-packages is library code."""
    assert code.is_user_file(package.__file__)
    with stampout.config.patch(watch_installed=False):
        assert not code.is_user_file(package.__file__)
    assert code.is_user_file(package.__file__)
