"""State that changes between calls must reach the next call: a tensor in a dataclass argument, a global tensor
rebound, a parameter replaced, a flag on a module object, a list attribute, an environment variable, a global read by
a nested helper, mutations that bypass `__setattr__`, a class attribute, a parametrization removed. Each compiled
call equals eager on the current state (values and gradients), or raises a `stampout.StampoutError`."""

from __future__ import annotations

import copy
import logging
import os
import types
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from blocks import Block, D, sample, stack_of
from helpers import check_call, check_capture
from torch import nn
from torch.nn.utils import parametrize

import stampout


@dataclass
class Batch:
    x: torch.Tensor
    bias: torch.Tensor


def test_case07_tensor_in_dataclass_argument() -> None:
    """A new dataclass argument with a new tensor of the same metadata on a later call."""
    model = stack_of(Block, 2)

    def prog(b: Batch) -> torch.Tensor:
        return model(b.x) + b.bias

    fn = stampout.compile(prog, backend="eager")
    x = sample()
    for value in (1.0, 2.0, -3.0):
        b = Batch(x, torch.full((D,), value))
        check_call(prog, fn, b, params_of=model, what=f"bias={value}")


TABLE = torch.full((D,), 1.0)


def _use_table(x: torch.Tensor) -> torch.Tensor:
    return x * TABLE


def test_case08_global_tensor_rebound() -> None:
    """A global tensor rebound to another of the same metadata (`TABLE = torch.full(...)`)."""
    global TABLE
    saved = TABLE
    fn = stampout.compile(_use_table, backend="eager")
    try:
        for value in (1.0, 2.0, 7.0):
            TABLE = torch.full((D,), value)
            check_call(_use_table, fn, sample(), grad=False, what=f"TABLE={value}")
    finally:
        TABLE = saved


def test_case09_parameter_replaced_through_parameters_dict() -> None:
    """`module._parameters["weight"] = new_param` between compiled calls."""
    model = stack_of(Block, 2)
    fn = stampout.compile(model, backend="eager")
    x = sample()
    check_call(model, fn, x, what="first")
    lin = model[1].mlp.fc
    lin._parameters["weight"] = nn.Parameter(torch.full((D, D), 0.5))
    check_call(model, fn, x, what="after _parameters swap")
    lin._parameters["bias"] = nn.Parameter(torch.full((D,), -2.0))
    check_call(model, fn, x, what="after bias swap")


cfgmod = types.ModuleType("cfgmod")
cfgmod.FLAG = False  # type: ignore[attr-defined]


class FlagBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if cfgmod.FLAG:
            h = torch.relu(h)
        return h


def test_case10_flag_on_module_object_namespace() -> None:
    """`if cfgmod.FLAG:` where `cfgmod` is a `types.ModuleType` in globals, flipped between calls."""
    model = stack_of(FlagBlock, 2)
    fn = stampout.compile(model, backend="eager")
    try:
        cfgmod.FLAG = False
        check_call(model, fn, sample(), what="FLAG=False")
        cfgmod.FLAG = True
        check_call(model, fn, sample(), what="FLAG=True")
        # capture, too: flipped between two region calls inside one program
        def prog(x: torch.Tensor) -> torch.Tensor:
            cfgmod.FLAG = False
            h = model[0](x)
            cfgmod.FLAG = True
            h = model[1](h)
            cfgmod.FLAG = False
            return h

        cap = check_capture(prog, sample(), params_of=model)
        assert cap.stats.traces == 2
    finally:
        cfgmod.FLAG = False


def test_case11_tensor_in_list_attribute_replaced() -> None:
    """`self.tables = [t]`, then `m.tables[0] = t2` between compiled calls."""

    class Tab(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(D, D)
            self.tables = [torch.ones(D)]

        @stampout.region
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * self.tables[0]

    model = stack_of(Tab, 2)
    fn = stampout.compile(model, backend="eager")
    check_call(model, fn, sample(), what="first")
    model[0].tables[0] = torch.full((D,), 3.0)
    check_call(model, fn, sample(), what="after tables[0] swap")
    model[1].tables[0] = torch.full((D,), -1.0)
    check_call(model, fn, sample(), what="after second swap")


def test_case13_per_instance_forward_installed_after_first_call() -> None:
    """A per-instance forward installed on a submodule after the first compiled call."""
    model = stack_of(Block, 3)
    fn = stampout.compile(model, backend="eager")
    check_call(model, fn, sample(), what="first")
    mlp = model[1].mlp
    mlp.forward = lambda x: mlp.fc(x) * -2.0
    check_call(model, fn, sample(), what="after patching layers[1].mlp.forward")
    model[2].forward = types.MethodType(lambda self, x: x * 0.5, model[2])
    check_call(model, fn, sample(), what="after patching layers[2].forward")


ENV_NAME = "STAMPOUT_SOUNDNESS_FLAG"


class EnvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if os.environ.get(ENV_NAME) == "1":
            h = torch.relu(h) * 3.0
        return x + h


def test_family_environment_variable_reads() -> None:
    """`os.environ.get(...)` read by a region, changed between region calls and between compiled calls."""
    model = stack_of(EnvBlock, 2)

    def prog(x: torch.Tensor) -> torch.Tensor:
        os.environ[ENV_NAME] = "0"
        h = model[0](x)
        os.environ[ENV_NAME] = "1"
        return model[1](h)

    try:
        check_capture(prog, sample(grad=True), params_of=model)
        os.environ[ENV_NAME] = "0"
        fn = stampout.compile(model, backend="eager")
        check_call(model, fn, sample(grad=True), what="flag 0")
        os.environ[ENV_NAME] = "1"
        check_call(model, fn, sample(grad=True), what="flag 1")
    finally:
        os.environ.pop(ENV_NAME, None)


G_SCALE = 0.5


def _scaled_inner(h: torch.Tensor) -> torch.Tensor:
    return h * G_SCALE


def _scaled_outer(h: torch.Tensor) -> torch.Tensor:
    return _scaled_inner(h) + 1.0


@stampout.region
def _chain_region(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(_scaled_outer(x))


def _chain_prog(x: torch.Tensor) -> torch.Tensor:
    return _chain_region(x) * 2.0


def test_family_global_read_by_a_nested_helper() -> None:
    """A region calls a module-level helper that calls another one that reads a global."""
    global G_SCALE

    def prog(x: torch.Tensor) -> torch.Tensor:
        global G_SCALE
        G_SCALE = 0.5
        h = _chain_region(x)
        G_SCALE = -3.0
        return _chain_region(h)

    try:
        cap = check_capture(prog, sample(grad=True))
        assert cap.stats.traces == 2
        G_SCALE = 0.5
        fn = stampout.compile(_chain_prog, backend="eager")
        check_call(_chain_prog, fn, sample(grad=True), what="G_SCALE=0.5")
        G_SCALE = 2.0
        check_call(_chain_prog, fn, sample(grad=True), what="G_SCALE=2.0")
    finally:
        G_SCALE = 0.5


_COMPILE_REGION_SCRIPT = """
import torch, stampout

@stampout.region
def layer(x):
    return torch.tanh(x) * 2.0

fn = stampout.compile(layer, backend="eager")
x = torch.randn(2, 4)
torch.testing.assert_close(fn(x), layer(x))
torch.testing.assert_close(fn(x * 2), layer(x * 2))
cap = stampout.capture(lambda t: layer(t) + 1.0, x)  # the process still works afterwards
torch.testing.assert_close(cap(x), layer(x) + 1.0)
print("OK")
"""


def test_family_compile_a_region_function_directly() -> None:
    """`stampout.compile(f)` where `f` is itself a `stampout.region` (run in a subprocess: a failure here has
    been seen to leave the process unable to capture anything)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _COMPILE_REGION_SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


@dataclass(slots=True)
class Slots:
    s: float = 0.5


class Configured(nn.Module):
    """Reads its scale from the one holder named by `which` (nothing else, so nothing else decides reuse)."""

    def __init__(self, which: str) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.which = which
        self.cfg = {"s": 0.5}
        self.items = [0.5]
        self.slots = Slots()
        self.ns = types.SimpleNamespace(s=0.5)
        self.raw = 0.5
        self.opt = 0.5
        self.perm = [0, 1, 2, 3]
        self.fc.weight.scale = 0.5  # a Python attribute on a parameter

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.which == "dict_item":
            h = h * self.cfg["s"]
        elif self.which == "list_item":
            h = h * self.items[0]
        elif self.which == "slots_field":
            h = h * self.slots.s
        elif self.which == "namespace_field":
            h = h * self.ns.s
        elif self.which in ("instance_dict_write", "object_setattr"):
            h = h * self.raw
        elif self.which == "list_in_place":
            h = h[:, self.perm]
        elif self.which == "delattr":
            h = h * getattr(self, "opt", 3.0)
        else:
            h = h * self.fc.weight.scale
        return x + torch.tanh(h)


MUTATIONS: dict[str, Callable[[Configured], None]] = {
    "dict_item": lambda m: m.cfg.__setitem__("s", 2.0),
    "list_item": lambda m: m.items.__setitem__(0, -1.0),
    "slots_field": lambda m: setattr(m.slots, "s", 3.0),
    "namespace_field": lambda m: setattr(m.ns, "s", -3.0),
    "instance_dict_write": lambda m: m.__dict__.__setitem__("raw", -2.0),
    "object_setattr": lambda m: object.__setattr__(m, "raw", 4.0),
    "list_in_place": lambda m: m.perm.reverse(),
    "delattr": lambda m: delattr(m, "opt"),
    "param_python_attr": lambda m: setattr(m.fc.weight, "scale", -0.5),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_family_compiled_guards_see_mutations_that_bypass_setattr(mutation: str) -> None:
    """Between compiled calls: in-place container edits, slots and SimpleNamespace fields, `__dict__` /
    `object.__setattr__` writes, `del`, and Python attributes of parameters all change what the region
    computes."""
    torch.manual_seed(0)
    model = nn.Sequential(Configured(mutation), Configured(mutation))
    fn = stampout.compile(model, backend="eager")
    check_call(model, fn, sample(grad=True), what="first")
    MUTATIONS[mutation](model[1])
    check_call(model, fn, sample(grad=True), what=f"after {mutation}")


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_family_capture_sees_per_layer_values_in_every_holder(mutation: str) -> None:
    """The same holders, differing between two layers of one captured stack."""
    torch.manual_seed(0)
    model = nn.Sequential(Configured(mutation), Configured(mutation))
    MUTATIONS[mutation](model[1])
    check_capture(model, sample(grad=True))


class ClassScaled(nn.Module):
    scale = 0.5

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    @classmethod
    def factor(cls) -> float:
        return cls.scale

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x) * self.factor())


def test_family_class_attribute_changed() -> None:
    """`Cls.scale = ...` (read through a classmethod) changed between region calls and between compiled calls."""
    model = stack_of(ClassScaled, 2)

    def prog(x: torch.Tensor) -> torch.Tensor:
        ClassScaled.scale = 0.5
        h = model[0](x)
        ClassScaled.scale = -2.0
        h = model[1](h)
        ClassScaled.scale = 0.5
        return h

    check_capture(prog, sample(grad=True), params_of=model)
    fn = stampout.compile(model, backend="eager")
    try:
        check_call(model, fn, sample(grad=True), what="scale=0.5")
        ClassScaled.scale = 3.0
        check_call(model, fn, sample(grad=True), what="scale=3.0")
    finally:
        ClassScaled.scale = 0.5


def test_family_parametrization_removed_after_compile() -> None:
    """`torch.nn.utils.parametrize` registered / removed between compiled calls (LoRA-style tooling)."""

    class Double(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2.0

    model = stack_of(Block, 2)
    fn = stampout.compile(model, backend="eager")
    check_call(model, fn, sample(grad=True), what="plain")
    parametrize.register_parametrization(model[1].mlp.fc, "weight", Double())
    check_call(model, fn, sample(grad=True), what="parametrized")
    parametrize.remove_parametrizations(model[1].mlp.fc, "weight", leave_parametrized=False)
    check_call(model, fn, sample(grad=True), what="parametrization removed")


class PlainTensorAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.mask = torch.ones(D)  # a tensor kept as a plain attribute (not a buffer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.mask


@pytest.mark.parametrize("write", [lambda m, t: m.__dict__.__setitem__("mask", t),
                                   lambda m, t: object.__setattr__(m, "mask", t)], ids=["dict_item", "object_setattr"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_calls_see_a_plain_tensor_attribute_replaced_bypassing_setattr(write, backend) -> None:
    torch.manual_seed(0)
    model = PlainTensorAttribute()
    fn = stampout.compile(model, backend=backend)
    check_call(model, fn, sample(grad=True), what="first")
    write(model, torch.full((D,), -2.0))
    check_call(model, fn, sample(grad=True), what="after the write")


class CountsBehindSetattr(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        object.__setattr__(self, "calls", self.calls + 1)  # (no watch sees it: nn.Module.__setattr__ is bypassed)
        return x * self.calls


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_count_kept_behind_setattr_counts_every_compiled_call(backend) -> None:
    model = CountsBehindSetattr()
    fn = stampout.compile(model, backend=backend)
    for n in range(1, 5):
        torch.testing.assert_close(fn(torch.ones(2)), torch.full((2,), float(n)))
        assert model.calls == n


class KeepsATupleState(nn.Module):
    """An LSTM cell's `(h, c)` kept between calls as a tuple made during the call, beside a tuple of constants and
    an existing module."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(4, 4)
        self.state = None
        self.meta = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, c = self.cell(x, self.state)
        self.state = (h.detach(), c.detach())
        self.meta = (x.shape[0], "step", self.cell)
        return h


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_tuple_state_made_during_the_call_is_replayed_not_run_eagerly(backend, caplog):
    """A tuple the call makes is stored again by each compiled call, item by item (was: refused as an object made
    during the call: every call ran eagerly)."""
    torch.manual_seed(0)
    model = KeepsATupleState()
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend=backend)
    with caplog.at_level(logging.WARNING, logger="stampout"):
        for _ in range(4):
            x = torch.randn(2, 4)
            torch.testing.assert_close(fn(x), reference(x))
            assert type(model.state) is tuple and model.meta[2] is model.cell and model.meta[:2] == reference.meta[:2]
            for ours, theirs in zip(model.state, reference.state):
                assert type(ours) is torch.Tensor
                torch.testing.assert_close(ours, theirs)
    assert "runs eagerly" not in caplog.text
    assert fn.stats.captures == 2  # (None, then the tuple)
