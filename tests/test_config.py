"""stampout.config: one table of switches, read where they decide, changed for a block by `config.patch`."""

from __future__ import annotations

import io
import logging
import pathlib
import re
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import stampout
from stampout import _logging, config
from stampout.backends import progress
from stampout.watch import world, world_snapshot

SRC = pathlib.Path(stampout.__file__).parent


def test_patch_sets_for_the_block_and_puts_back():
    assert config.glue == "auto" and config.thin_glue == 1.0
    with config.patch(glue="whole", thin_glue=3.0):
        assert (config.glue, config.thin_glue) == ("whole", 3.0)
        with config.patch(glue="apart"):
            assert config.glue == "apart"
        assert config.glue == "whole"
    assert (config.glue, config.thin_glue) == ("auto", 1.0)


def test_patch_puts_back_after_an_error():
    with pytest.raises(ValueError), config.patch(scan_depth=7):
        assert config.scan_depth == 7
        raise ValueError
    assert config.scan_depth == 3


def test_patch_as_a_decorator_applies_per_call():
    @config.patch(progress_delay=0.5)
    def delay():
        return config.progress_delay

    assert delay() == 0.5 and delay() == 0.5
    assert config.progress_delay == 2.0


def test_patch_refuses_an_unknown_switch_and_lists_the_switches():
    with pytest.raises(AttributeError, match=r"no switch gleu; the switches: logs, progress, "):
        with config.patch(gleu="whole"):
            pass
    assert not hasattr(config, "gleu")


def test_values_lists_every_switch():
    assert set(config.values()) == {s.name for s in config.SWITCHES}
    with config.patch(cpp_wrapper=False):
        assert config.values()["cpp_wrapper"] is False


@pytest.mark.parametrize("name, raw, value", [
    ("progress", "0", False), ("progress", "1", True), ("progress", None, True),
    ("check_world", "1", True), ("check_world", "0", False), ("check_world", None, False),
    ("logs", "+regions", "+regions"), ("logs", None, ""),
])
def test_environment_variables_set_the_initial_value(name, raw, value, monkeypatch):
    switch = next(s for s in config.SWITCHES if s.name == name)
    if raw is None:
        monkeypatch.delenv(switch.env, raising=False)
    else:
        monkeypatch.setenv(switch.env, raw)
    assert switch.initial() == value


def test_the_suite_runs_with_the_world_check_on():
    assert config.check_world is True  # conftest.py sets STAMPOUT_CHECK_WORLD=1 before stampout is imported


def test_no_module_reads_stampout_environment_variables_but_config():
    readers = [p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")
               if p.name != "config.py" and re.search(r"environ(\.get)?\(?\[?\s*[\"']STAMPOUT_", p.read_text())]
    assert readers == []


def test_logging_reads_the_logs_switch():
    logger = logging.getLogger("stampout.guards")
    old = logger.level
    try:
        with config.patch(logs="+guards"):
            _logging.configure()
        assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(old)


def test_progress_reads_the_progress_switch():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert progress._wanted(Terminal())
    with config.patch(progress=False):
        assert not progress._wanted(Terminal())


def _fakes(n):
    with FakeTensorMode() as mode:
        return [mode.from_tensor(torch.zeros(2)) for _ in range(n)], mode


def test_world_check_reads_check_world():
    fakes, _ = _fakes(1)
    holder = types.SimpleNamespace(left=fakes[0])
    with config.patch(check_world=False):
        world_snapshot.check_left_over(world_snapshot.Snapshot(), [holder])
    with config.patch(check_world=True), pytest.raises(AssertionError, match="left traced values in"):
        world_snapshot.check_left_over(world_snapshot.Snapshot(), [holder])


def test_world_scan_reads_its_limits():
    fakes, _ = _fakes(3)
    assert world.holds_fake(fakes)
    with config.patch(scan_items=2):
        assert not world.holds_fake(fakes)
    with config.patch(scan_depth=0):
        assert not world.holds_fake(fakes)
