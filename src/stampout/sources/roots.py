"""Sources that start a path: a leaf or argument of the call, a value held by reference, an anchor, a closure
cell, an attribute or global of the called function. (Imported through the package, `stampout.sources`.)
"""

from __future__ import annotations

from typing import Any

from .base import MISSING, Source


class _Root(Source):
    """A source that starts a path: the `index`-th of something its kind names (`key`), written as `label`."""

    __slots__ = ("index", "label")
    KIND = ""

    def __init__(self, index: Any, label: str) -> None:
        self.index = index
        self.label = label

    def key(self) -> tuple:
        return (self.KIND, self.index)

    def name(self) -> str:
        return self.label

    def rebase(self, fn):
        return fn(self)


class Arg(_Root):
    """The `index`-th flat leaf of the call's `(args, kwargs)`; `label` is how a user would write it."""

    __slots__ = ()
    KIND = "arg"

    def _step(self, ctx, memo):
        leaves = ctx.leaves
        return leaves[self.index] if self.index < len(leaves) else MISSING

    def expr(self, base_expr: str) -> str:
        return f"_leaf(leaves, {self.index})"


class Input(_Root):
    """A positional (`index` an int) or keyword (`index` a str) argument of the call, as passed: a list or dict
    the program may fill (opened into leaves, so no Arg names it). Replayed effects resolve it; guards never read
    it (the fingerprint holds the containers' structure)."""

    __slots__ = ()
    KIND = "input"

    def _step(self, ctx, memo):
        if ctx.inputs is None:
            return MISSING
        args, kwargs = ctx.inputs
        if type(self.index) is int:
            return args[self.index] if self.index < len(args) else MISSING
        return kwargs.get(self.index, MISSING)

    def expr(self, base_expr: str) -> str:
        return "_MISSING"


class Absolute(Source):
    """A value held by reference (a globals dict, a closure cell, a root module)."""

    __slots__ = ("obj", "label")

    def __init__(self, obj: Any, label: str) -> None:
        self.obj = obj
        self.label = label

    def key(self) -> tuple:
        return ("abs", id(self.obj))

    def name(self) -> str:
        return self.label

    def rebase(self, fn):
        return fn(self)

    def _step(self, ctx, memo):
        return self.obj

    def expr(self, base_expr: str) -> str:
        raise AssertionError("Absolute sources are bound as constants by the guard compiler")


class Anchor(_Root):
    """An object a per-call check reaches through watched modules, resolved once per epoch by the compiled
    function and passed to the generated check as `anchors[index]` (see protection.anchored)."""

    __slots__ = ()
    KIND = "anchor"

    def _step(self, ctx, memo):
        anchors = getattr(ctx, "anchors", None)
        if anchors is None:
            raise AssertionError("an Anchor is resolved by its compiled function or an AnchoredContext")
        return anchors[self.index]

    def expr(self, base_expr: str = "") -> str:
        return f"anchors[{self.index}]"


class Closure(Source):
    """Closure cell `var` (position `index`) of the called function."""

    __slots__ = ("index", "var")

    def __init__(self, index: int, var: str) -> None:
        self.index = index
        self.var = var

    def key(self) -> tuple:
        return ("closure", self.index)

    def name(self) -> str:
        return f"closure[{self.var!r}]"

    def rebase(self, fn):
        return fn(self)

    def _step(self, ctx, memo):
        return _cell(ctx.fn, self.index)

    def expr(self, base_expr: str) -> str:
        return f"_cell(fn, {self.index})"


class FnAttr(Source):
    """An attribute of the called function itself (`__defaults__`, `__kwdefaults__`)."""

    __slots__ = ("attr",)

    def __init__(self, attr: str) -> None:
        self.attr = attr

    def key(self) -> tuple:
        return ("fn", self.attr)

    def name(self) -> str:
        return f"fn.{self.attr}"

    def rebase(self, fn):
        return fn(self)

    def _step(self, ctx, memo):
        return getattr(ctx.fn, self.attr, MISSING)

    def expr(self, base_expr: str) -> str:
        return f"getattr(fn, {self.attr!r}, _MISSING)"


class Global(Source):
    """Global `var` of the called function's module."""

    __slots__ = ("var",)

    def __init__(self, var: str) -> None:
        self.var = var

    def key(self) -> tuple:
        return ("global", self.var)

    def name(self) -> str:
        return f"globals[{self.var!r}]"

    def rebase(self, fn):
        return fn(self)

    def _step(self, ctx, memo):
        return ctx.fn.__globals__.get(self.var, MISSING)

    def expr(self, base_expr: str) -> str:
        return f"fn.__globals__.get({self.var!r}, _MISSING)"


def _cell(fn: Any, index: int) -> Any:
    closure = getattr(fn, "__closure__", None)
    if not closure or index >= len(closure):
        return MISSING
    try:
        return closure[index].cell_contents
    except ValueError:  # an empty cell
        return MISSING


def _leaf(leaves: list[Any], index: int) -> Any:
    return leaves[index] if index < len(leaves) else MISSING
