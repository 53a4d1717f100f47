"""Automatic regions: repeated children of `ModuleList`s and `Sequential`s marked without code changes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .marker import region

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential)


@contextlib.contextmanager
def auto_regions(module: torch.nn.Module, min_repeats: int = 2) -> Iterator[list[str]]:
    """Mark, for the duration of the `with` block, every child of a `ModuleList` or `Sequential` whose class
    repeats at least `min_repeats` times there, as `stampout.region(child)` would; unmark them after.

    Example::

        with stampout.auto_regions(model) as marked:    # e.g. ["model.layers.0", ..., "model.layers.31"]
            cap = stampout.capture(model, input_ids)

    Yields:
        The qualified names of the modules it marked.
    """
    marked: list[torch.nn.Module] = []
    names: list[str] = []
    try:
        for prefix, container in module.named_modules():
            if not isinstance(container, _CONTAINERS):
                continue
            by_class: dict[type, list[tuple[str, torch.nn.Module]]] = {}
            for key, child in container.named_children():
                by_class.setdefault(type(child), []).append((key, child))
            for children in by_class.values():
                if len(children) < min_repeats:
                    continue
                for key, child in children:
                    if "forward" in child.__dict__:
                        continue  # its forward is already rebound (marked by hand, or by something else)
                    region(child)
                    marker = child.__dict__["forward"].__func__
                    marker.__stampout_auto__ = True  # transient: see Kind.NO_OVERRIDE
                    marker.__stampout_region__.automatic = True
                    marked.append(child)
                    names.append(f"{prefix}.{key}" if prefix else key)
        yield names
    finally:
        for child in marked:
            child.__dict__.pop("forward", None)
