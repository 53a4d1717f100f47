"""Seeded construction for the zoo models: deterministic weights, the caller's RNG untouched."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def seeded(seed: int | None):
    """Run the body under ``torch.manual_seed(seed)`` without disturbing the caller's RNG state."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
