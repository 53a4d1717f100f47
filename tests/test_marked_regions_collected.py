"""Functions marked with `torch.compiler.nested_compile_region` live as long as their user keeps them: stampout's
handling of their calls (regions/marker.py) keeps no registry of them, so one marked, called in a capture and
dropped is collected with the capture."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import stampout
from stampout.errors import RegionError


def _marked_and_captured() -> tuple[weakref.ref, weakref.ref]:
    def block(x):
        return torch.relu(x) * 2

    marked = torch.compiler.nested_compile_region(block)

    def program(x):
        return marked(x) + marked(x)

    x = torch.randn(2, 2)
    capture = stampout.capture(program, x)
    assert capture.stats.traces == 1 and capture.stats.reuses == 1
    torch.testing.assert_close(capture(x), program(x))
    return weakref.ref(block), weakref.ref(capture)


def test_a_marked_function_dropped_after_a_capture_is_collected():
    block, capture = _marked_and_captured()
    gc.collect()
    assert capture() is None
    assert block() is None, "a registry still holds the nested_compile_region function"


def test_marking_again_with_other_settings_takes_effect():
    # (torch keeps the settings on the function: a second marking replaces them, and the next capture sees it)
    def block(x):
        return x.sin()

    def program(x):
        return marked(x) + marked(x[:2]).sum()

    marked = torch.compiler.nested_compile_region(block, max_reuse_entries=1)
    with pytest.raises(RegionError, match="max_reuse_entries=1"):
        stampout.capture(program, torch.randn(3))
    marked = torch.compiler.nested_compile_region(block, max_reuse_entries=2)
    x = torch.randn(3)
    capture = stampout.capture(program, x)
    assert capture.stats.traces == 2
    torch.testing.assert_close(capture(x), program(x))
