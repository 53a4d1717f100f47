"""Sources: where a value came from, as a path a user would type (`self.layers[3].attn.eps`).

A source is relative to a *call context*: the flat leaves of a region call's `(args, kwargs)` and the
function being called (for its closure cells and globals). Stamping out a cached region call resolves
the entry's sources against the new call's context, which is how `args[0].attn.eps` recorded on
`layers[0]` is checked as `layers[1].attn.eps`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MISSING = object()  # an attribute, item or cell that is not there
_UNSEEN = object()  # (a source not resolved yet in a memo)


class Source:
    """A path from a call context to a value. Immutable and hashable."""

    __slots__ = ("_hash",)

    def key(self) -> tuple:
        raise NotImplementedError

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            self._hash = hash(self.key())
            return self._hash

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.key() == self.key()

    def __repr__(self) -> str:
        return self.name()

    def name(self) -> str:
        raise NotImplementedError

    def base(self) -> Source | None:
        return None

    def rebase(self, fn: Callable[[Source], Source | None]) -> Source | None:
        """This path with its root replaced by `fn(root)`; None when `fn` has no answer."""
        raise NotImplementedError

    def resolve(self, ctx: CallContext, memo: dict[Source, Any]) -> Any:
        """The value at this path in `ctx` (MISSING when a step fails), memoized by source."""
        value = memo.get(self, _UNSEEN)  # (not try/except: a miss, the common case per call, raises nothing)
        if value is _UNSEEN:
            value = memo[self] = self._step(ctx, memo)
        return value

    def _step(self, ctx: CallContext, memo: dict[Source, Any]) -> Any:
        raise NotImplementedError

    def operands(self) -> tuple[Source, ...]:
        """Other sources this step reads (their expressions follow the base's in `expr`)."""
        return ()

    def expr(self, base_expr: str) -> str:
        """Python expression for this step, given the expression of its base (for generated guards)."""
        raise NotImplementedError


class CallContext:
    """What sources are resolved against: the flat input leaves of a call and the called function."""

    __slots__ = ("leaves", "fn", "inputs")

    def __init__(self, leaves: list[Any], fn: Callable | None, inputs: tuple[tuple, dict] | None = None) -> None:
        self.leaves = leaves
        self.fn = fn
        self.inputs = inputs  # the call's (args, kwargs): its lists and dicts, which no leaf names


class AnchoredContext(CallContext):
    """A call context whose `Anchor` sources read `anchors` (the objects a passed check started from)."""

    __slots__ = ("anchors",)

    def __init__(self, ctx: CallContext, anchors: tuple) -> None:
        super().__init__(ctx.leaves, ctx.fn, ctx.inputs)
        self.anchors = anchors


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


class Attr(Source):
    """Attribute `attr` of the base value."""

    __slots__ = ("parent", "attr")

    def __init__(self, parent: Source, attr: str) -> None:
        self.parent = parent
        self.attr = attr

    def key(self) -> tuple:
        return ("attr", self.parent.key(), self.attr)

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
        return MISSING if obj is MISSING else getattr(obj, self.attr, MISSING)

    def expr(self, base_expr: str) -> str:
        return f"getattr({base_expr}, {self.attr!r}, _MISSING)"


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
    if container is MISSING:
        return MISSING
    try:
        return container[key]
    except (KeyError, IndexError, TypeError):
        return MISSING


def _slot_item(container: Any, index: Any) -> Any:
    return _item(container, index) if type(index) is int else MISSING


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


def module_path(root: Source, qualified_name: str) -> Source:
    """`self.layers.3.attn` as nested Attr sources under `root` (printed `self.layers[3].attn`)."""
    source = root
    if qualified_name:
        for part in qualified_name.split("."):
            source = Attr(source, part)
    return source


RESOLVE_HELPERS = {"_item": _item, "_slot_item": _slot_item, "_cell": _cell, "_leaf": _leaf, "_type_of": _type_of,
                   "mro_attr": mro_attr, "_MISSING": MISSING}
