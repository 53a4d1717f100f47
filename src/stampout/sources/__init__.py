"""Sources: where a value came from, as a path a user would type (`self.layers[3].attn.eps`).

A source is relative to a *call context*: the flat leaves of a region call's `(args, kwargs)` and the
function being called (for its closure cells and globals). Stamping out a cached region call resolves
the entry's sources against the new call's context, which is how `args[0].attn.eps` recorded on
`layers[0]` is checked as `layers[1].attn.eps`.

A layer below trace/: sources name values and know nothing of guards, so the tracer (the sources of lifted
tensors), watch/ (MISSING) and guards/ all import them from here.
"""

from __future__ import annotations

from typing import Any

from .base import MISSING, AnchoredContext, CallContext, Place, Source
from .roots import Absolute, Anchor, Arg, Closure, FnAttr, Global, Input, _cell, _leaf

__all__ = ("MISSING", "AnchoredContext", "CallContext", "Place", "Source", "Absolute", "Anchor", "Arg", "Closure",
           "FnAttr", "Global", "Input", "Attr", "TypeOf", "ClassAttr", "Item", "SlotItem", "mro_attr",
           "module_path", "RESOLVE_HELPERS", "_item", "_slot_item", "_type_of", "_cell", "_leaf")


class Attr(Source):
    """Attribute `attr` of the base value."""

    __slots__ = ("parent", "attr")

    def __init__(self, parent: Source, attr: str) -> None:
        self.parent = parent
        self.attr = attr

    def key(self) -> tuple:
        return ("attr", self.parent.key(), self.attr)

    def __hash__(self) -> int:
        """From the parent's (cached) hash, not its key built again: a new path to a parameter of a deep model hashes
        in one step. Equal keys give equal hashes still: a parent's hash is a function of its key (only Attr keys
        start with "attr")."""
        try:
            return self._hash
        except AttributeError:
            self._hash = hash(("attr", hash(self.parent), self.attr))
            return self._hash

    def name(self) -> str:
        if self.attr.isdigit():
            return f"{self.parent.name()}[{self.attr}]"
        return f"{self.parent.name()}.{self.attr}"

    def base(self) -> Source:
        return self.parent

    def rebase(self, fn):
        parent = self.parent.rebase(fn)
        return None if parent is None else Attr(parent, self.attr)

    def with_parent(self, parent: Source) -> Source:
        return Attr(parent, self.attr)

    def _step(self, ctx, memo):
        obj = self.parent.resolve(ctx, memo)
        if self.attr == "cell_contents":
            return _cell_contents(obj)
        return MISSING if obj is MISSING else getattr(obj, self.attr, MISSING)

    def expr(self, base_expr: str) -> str:
        if self.attr == "cell_contents":
            return f"_cell_contents({base_expr})"
        return f"getattr({base_expr}, {self.attr!r}, _MISSING)"


def _cell_contents(cell: Any) -> Any:
    """A closure cell's value; MISSING for an empty cell (which raises ValueError, not AttributeError)."""
    try:
        return cell.cell_contents
    except (AttributeError, ValueError):
        return MISSING


class TypeOf(Source):
    """The class of the base value (its own class, not a watching shim stampout gave it)."""

    __slots__ = ("parent",)

    def __init__(self, parent: Source) -> None:
        self.parent = parent

    def key(self) -> tuple:
        return ("type", self.parent.key())

    def name(self) -> str:
        return f"type({self.parent.name()})"

    def base(self) -> Source:
        return self.parent

    def rebase(self, fn):
        parent = self.parent.rebase(fn)
        return None if parent is None else TypeOf(parent)

    def with_parent(self, parent: Source) -> Source:
        return TypeOf(parent)

    def _step(self, ctx, memo):
        return _type_of(self.parent.resolve(ctx, memo))

    def expr(self, base_expr: str) -> str:
        return f"_type_of({base_expr})"


class ClassAttr(Source):
    """Attribute `attr` as the class at `parent` defines it along its MRO, unbound: a method's function, a
    property object, a class-level default (`ClassAttr(TypeOf(self), "forward")`)."""

    __slots__ = ("parent", "attr")

    def __init__(self, parent: Source, attr: str) -> None:
        self.parent = parent
        self.attr = attr

    def key(self) -> tuple:
        return ("classattr", self.parent.key(), self.attr)

    def name(self) -> str:
        return f"{self.parent.name()}.{self.attr}"

    def base(self) -> Source:
        return self.parent

    def rebase(self, fn):
        parent = self.parent.rebase(fn)
        return None if parent is None else ClassAttr(parent, self.attr)

    def with_parent(self, parent: Source) -> Source:
        return ClassAttr(parent, self.attr)

    def _step(self, ctx, memo):
        return mro_attr(self.parent.resolve(ctx, memo), self.attr)

    def expr(self, base_expr: str) -> str:
        return f"mro_attr({base_expr}, {self.attr!r})"


class Item(Source):
    """Item `item` of the base container (list index or dict key)."""

    __slots__ = ("parent", "item")

    def __init__(self, parent: Source, item: Any) -> None:
        self.parent = parent
        self.item = item

    def key(self) -> tuple:
        return ("item", self.parent.key(), type(self.item), self.item)

    def name(self) -> str:
        return f"{self.parent.name()}[{self.item!r}]"

    def base(self) -> Source:
        return self.parent

    def rebase(self, fn):
        parent = self.parent.rebase(fn)
        return None if parent is None else Item(parent, self.item)

    def with_parent(self, parent: Source) -> Source:
        return Item(parent, self.item)

    def _step(self, ctx, memo):
        return _item(self.parent.resolve(ctx, memo), self.item)

    def expr(self, base_expr: str) -> str:
        return f"_item({base_expr}, {self.item!r})"


class SlotItem(Source):
    """Item `parent[index]` where the index is itself read from a source of the call (`self.attn.layer_idx`)."""

    __slots__ = ("parent", "index")

    def __init__(self, parent: Source, index: Source) -> None:
        self.parent = parent
        self.index = index

    def key(self) -> tuple:
        return ("slotitem", self.parent.key(), self.index.key())

    def name(self) -> str:
        return f"{self.parent.name()}[{self.index.name()}]"

    def base(self) -> Source:
        return self.parent

    def rebase(self, fn):
        parent, index = self.parent.rebase(fn), self.index.rebase(fn)
        return None if parent is None or index is None else SlotItem(parent, index)

    def with_parent(self, parent: Source) -> Source:
        return SlotItem(parent, self.index)

    def operands(self) -> tuple[Source, ...]:
        return (self.index,)

    def _step(self, ctx, memo):
        return _slot_item(self.parent.resolve(ctx, memo), self.index.resolve(ctx, memo))

    def expr(self, base_expr: str, index_expr: str = "") -> str:
        return f"_slot_item({base_expr}, {index_expr})"


def _item(container: Any, key: Any) -> Any:
    """`container[key]`; of a dict subclass, the item as stored (its own `__getitem__` or `__missing__` is its
    Python, which may make a new value per read, or log it: transformers' ACT2FN makes an activation module)."""
    if container is MISSING:
        return MISSING
    try:
        if isinstance(container, dict) and type(container) is not dict:
            return dict.__getitem__(container, key)
        return container[key]
    except (KeyError, IndexError, TypeError):
        return MISSING


def _slot_item(container: Any, index: Any) -> Any:
    if type(index) is not int or container is MISSING:  # (one call: a deep model's check makes one per layer)
        return MISSING
    try:
        return container[index]
    except (KeyError, IndexError, TypeError):
        return MISSING


def _type_of(obj: Any) -> Any:
    if obj is MISSING:
        return MISSING
    cls = type(obj)
    return cls.__dict__.get("_stampout_original", cls)  # a watching shim stands in for the class


def mro_attr(cls: Any, attr: str) -> Any:
    if not isinstance(cls, type):
        return MISSING
    for klass in cls.__mro__:
        d = klass.__dict__
        if attr in d:
            return d[attr]
    return MISSING


def module_path(root: Source, qualified_name: str) -> Source:
    """`self.layers.3.attn` as nested Attr sources under `root` (printed `self.layers[3].attn`)."""
    source = root
    if qualified_name:
        for part in qualified_name.split("."):
            source = Attr(source, part)
    return source


RESOLVE_HELPERS = {"_item": _item, "_PLAIN_ITEMS": (dict, list, tuple), "_slot_item": _slot_item, "_cell": _cell, "_leaf": _leaf, "_type_of": _type_of,
                   "mro_attr": mro_attr, "_MISSING": MISSING, "_cell_contents": _cell_contents}
