"""`stampout.region`: marking functions, methods and module instances as regions.

Outside a capture a region call is a plain call. Inside one it goes to the capture's region handler,
keyed by the innermost function's `__code__`. Functions marked with `torch.compiler.nested_compile_region`
reach the same handler while a capture runs (see `torch_marked_call`).
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..context import current
from ..errors import RegionError, message
from ..trace.frames import user_location
from ..trace.structure import positional_names

DEFAULT_MAX_REUSE_ENTRIES = 8


@dataclass(eq=False)
class Region:
    """A marked function: its innermost function and its reuse settings."""

    fn: Callable
    max_reuse_entries: int = DEFAULT_MAX_REUSE_ENTRIES
    reuse_hash_fn: Callable | None = None
    automatic: bool = False  # marked by regions="auto": past max_reuse_entries it traces inline, no error
    code: types.CodeType = field(init=False)
    name: str = field(init=False)
    arg_names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.code = self.fn.__code__
        self.name = getattr(self.fn, "__qualname__", self.code.co_name)
        self.arg_names = positional_names(self.fn)


def innermost(fn: Any) -> Any:
    """The function under any stampout or torch region wrappers."""
    while True:
        marked = getattr(fn, "__stampout_region__", None)
        if marked is not None:
            fn = marked.fn
            continue
        inner = getattr(fn, "__marked_compile_region_fn__", None)
        if inner is not None:
            fn = inner
            continue
        return fn


def region(
    fn: Callable | torch.nn.Module | None = None,
    *,
    max_reuse_entries: int = DEFAULT_MAX_REUSE_ENTRIES,
    reuse_hash_fn: Callable | None = None,
) -> Any:
    """Mark a function, method or module instance as a region: traced once, stamped out when equivalent.

    Example::

        class Layer(nn.Module):
            @stampout.region
            def forward(self, x):
                return torch.relu(self.lin(x))

        block = stampout.region(layer)        # a module instance: its forward becomes a region
        Layer.forward = stampout.region(Layer.forward)   # or wrap at class level

    Args:
        fn: the function, method or `nn.Module` instance.
        max_reuse_entries: how many distinct traces one region may keep before it is an error.
        reuse_hash_fn: called with the region's arguments; calls returning the same int share one trace.

    Returns:
        A function with the same signature (for a module instance: the instance, its forward rebound).
    """
    if type(max_reuse_entries) is not int or max_reuse_entries < 1:  # refused where it is written
        raise RegionError(message(
            f"max_reuse_entries must be a positive int, got {max_reuse_entries!r}",
            user_location(), "pass max_reuse_entries=8 (the default) or another positive int",
        ))
    if reuse_hash_fn is not None and not callable(reuse_hash_fn):
        raise RegionError(message(
            f"reuse_hash_fn must be a callable returning an int, got {type(reuse_hash_fn).__name__}",
            user_location(), "pass a function of the region's arguments, e.g. reuse_hash_fn=lambda self, x: 0",
        ))
    if fn is None:
        return functools.partial(region, max_reuse_entries=max_reuse_entries, reuse_hash_fn=reuse_hash_fn)
    if isinstance(fn, torch.nn.Module):
        module = fn
        forward = region(type(module).forward, max_reuse_entries=max_reuse_entries,
                         reuse_hash_fn=reuse_hash_fn)
        module.forward = types.MethodType(forward, module)
        return module
    if inspect.ismethod(fn) and not isinstance(fn.__self__, type):
        # A bound method (`layer.forward`): the region is the function, called with its `self` first, so
        # what it reads through `self` is guarded relative to the call like any argument.
        owner, marked = fn.__self__, region(fn.__func__, max_reuse_entries=max_reuse_entries,
                                            reuse_hash_fn=reuse_hash_fn)
        return functools.wraps(fn)(functools.partial(marked, owner))
    inner = innermost(fn)
    if not hasattr(inner, "__code__"):
        raise RegionError(message(
            f"stampout.region needs a Python function or an nn.Module, got {type(fn).__name__}",
            user_location(), "mark the Python function (or the module) that does the work",
        ))
    info = Region(inner, max_reuse_entries, reuse_hash_fn)

    @functools.wraps(inner)
    def call_region(*args: Any, **kwargs: Any) -> Any:
        ctx = current()
        if ctx is None:
            return inner(*args, **kwargs)
        return ctx.handler.call(info, args, kwargs)

    call_region.__stampout_region__ = info  # type: ignore[attr-defined]
    return call_region


def torch_marked_call(func: Callable, *args: Any, **kwargs: Any) -> Any:
    """Stands in for torch's `invoke_subgraph_placeholder` while a capture runs."""
    ctx = current()
    if ctx is None:
        return func(*args, **kwargs)
    if inspect.ismethod(func) and not isinstance(func.__self__, type):  # nested_compile_region(layer.forward)
        args, func = (func.__self__, *args), func.__func__
    elif isinstance(func, torch.nn.Module):  # nested_compile_region(layer): a region of its class's forward
        args, func = (func, *args), innermost(type(func).forward)
    # torch keeps the settings on the function itself, so marking it again (another reuse_hash_fn) replaces them.
    # Note: no registry of these functions. A memo keyed by the function would hold it through its value's `fn`
    # (a weak key does not help: the value keeps the key alive), so every marked function would live as long as
    # the process; a Region costs a few attribute reads, so each call makes its own (the handler keys its
    # entries by `region.code`, never by the Region).
    limit = getattr(func, "__marked_compile_region_max_reuse_entries__", DEFAULT_MAX_REUSE_ENTRIES)
    hash_fn = getattr(func, "__marked_compile_region_reuse_hash_fn__", None)
    return ctx.handler.call(Region(func, limit, hash_fn), args, kwargs)
