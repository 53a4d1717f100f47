"""Names and sources of the tensors a program can reach: what lifted placeholders are called and where
`cap(...)` finds their live values.

Sources are relative to a call context whose leaves are `[fn, *flat inputs]`: the root module is
`Arg(0)` (`self`), an input object is `Arg(i + 1)`, so each call resolves them against its own inputs."""

from __future__ import annotations

import contextlib
import keyword
import re
import types
from collections.abc import Callable
from typing import Any

import torch

from .. import caches, config
from ..sources import Absolute, Arg, Attr, Item, Source, module_path


def written_as_is(name: str) -> bool:
    """Whether `name` may be written in generated code as `obj.name`: Python's compiler reads an identifier after
    NFKC normalisation (`obj.\ufb01` is `obj.fi`) where getattr/setattr take the string as it is, so only plain
    ASCII identifiers that are not keywords qualify; any other name goes through getattr/setattr."""
    return name.isascii() and name.isidentifier() and not keyword.iskeyword(name)


def identifier(text: str, fallback: str = "input") -> str:
    """A valid Python identifier named after `text`, as torch.export names its placeholders: each run of other
    characters becomes one "_" (`layers.0.weight` -> layers_0_weight, `batch['input-ids']` -> batch_input_ids);
    a leading digit gets a "_"; `fallback` when nothing is left."""
    name = text.replace(".", "_")
    if name.isascii() and name.isidentifier() and not name[0].isdigit():  # (ASCII: see written_as_is)
        return name
    name = re.sub(r"[^0-9a-zA-Z_]+", "_", text).strip("_") or fallback
    return f"_{name}" if name[0].isdigit() else name


_EMPTY = types.MappingProxyType({})
# What nn.Module.__init__ puts in every module's __dict__ (none is a tensor); `training` included
_MODULE_FIELDS = frozenset(torch.nn.Module().__dict__)


def root_module(fn: Callable) -> torch.nn.Module | None:
    if isinstance(fn, torch.nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


_Module = torch.nn.Module
_Tensor = torch.Tensor
_PLAIN_TREE: dict[type, bool] = caches.register({}, "names module classes listed without named_modules")


def _plain_tree(cls: type) -> bool:
    """Whether a module of exact class `cls` is listed by nn.Module's own `modules`/`named_modules` (not its class's:
    a `_modules` of its own, another `__getattribute__`, hash or equality, which the listing's memo uses)."""
    plain = _PLAIN_TREE.get(cls)
    if plain is None:
        plain = _PLAIN_TREE[cls] = (issubclass(cls, _Module) and cls.named_modules is _Module.named_modules
                                    and cls.modules is _Module.modules and cls.__hash__ is _Module.__hash__
                                    and cls.__eq__ is _Module.__eq__
                                    and cls.__getattribute__ is _Module.__getattribute__
                                    and not any("_modules" in vars(k) for k in cls.__mro__))
    return plain


def _read_as_dict(children: Any) -> bool:
    """A dict subclass whose items and values are dict's (a watched module's `_modules`, `watch/tracking._BumpingDict`,
    which only adds to writes): `named_modules` reads it as the walk does."""
    cls = type(children)
    return isinstance(children, dict) and cls.items is dict.items and cls.values is dict.values


def module_tree(root: torch.nn.Module) -> list[torch.nn.Module]:
    """`list(root.modules())`, without its generator per module (each module passing up through every level above
    it) and its names: the same modules in the same order (depth first, each once), by a walk of the `_modules`
    dicts where every class of the tree lists as nn.Module does (`_plain_tree`), else `root.modules()` itself."""
    out: list[torch.nn.Module] = []
    seen: set[int] = set()
    plain = _PLAIN_TREE
    stack = [root]
    while stack:
        m = stack.pop()
        if m is None or id(m) in seen:  # (a None in `_modules`: skipped, as nn.Module does)
            continue
        d = getattr(m, "__dict__", None)
        children = d.get("_modules") if type(d) is dict else None
        if (not (type(children) is dict or _read_as_dict(children)) or not (plain.get(type(m)) or _plain_tree(type(m)))
                or "named_modules" in d or "modules" in d):  # (an instance's own: they would shadow the methods)
            return list(root.modules())
        seen.add(id(m))
        out.append(m)
        if children:
            stack += reversed(children.values())
    return out


class TensorNames:
    """Placeholder name and source of each tensor the program can reach by name: parameters, buffers and
    tensor attributes of the root module's tree (and of modules in globals and closure cells), globals and
    closure cells of the function, and tensors held by input objects. The walk records qualified names and
    roots; sources are built for the few tensors that get lifted."""

    def __init__(self, fn: Callable, leaves: list[Any] = (), labels: list[str] = ()) -> None:
        self._found: dict[int, tuple[str, Source, str]] = {}  # id -> (name, root source, path below it)
        self._owners: dict[tuple[int, str], Source] = {}  # (id of a root source, module path) -> its source
        root = root_module(fn)
        if root is not None:
            self._walk(root, "", Arg(0, "self"), "")
            fn = type(root).forward if fn is root else fn
        # The call's own arguments before globals: a tensor (or module) reachable both ways is the argument's,
        # read from each call's argument (a global that happens to hold the example is not the input).
        for i, (leaf, label) in enumerate(zip(leaves, labels)):
            if isinstance(leaf, torch.nn.Module):
                self._walk(leaf, f"{label}.", Arg(i + 1, label))
            elif not isinstance(leaf, torch.Tensor):
                self._walk_object(leaf, label, Arg(i + 1, label), "", 0)
        self._functions: set[int] = set()
        self._globals: dict[tuple[int, Any], int] = {}  # (id of a globals dict, module) walked -> least depth
        self._walk_function(getattr(fn, "__func__", fn), 0)

    def _add(self, value: Any, name: str, root: Source, path: str) -> None:
        if isinstance(value, torch.Tensor) and id(value) not in self._found:
            self._found[id(value)] = (name, root, path)

    def _add_root(self, value: Any, name: str, source: Source, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            self._add(value, name, source, "")
        elif isinstance(value, torch.nn.Module):
            self._walk(value, f"{name}.", source)
        elif callable(value) and depth < config.names_max_depth:
            marked = getattr(value, "__stampout_region__", None)
            self._walk_function(marked.fn if marked is not None else value, depth + 1)

    def _walk_function(self, func: Any, depth: int) -> None:
        """Tensors and modules in a function's globals and closure cells, and in those of the functions
        found there (a region function the program calls, closing over a module)."""
        if not isinstance(func, types.FunctionType) or id(func) in self._functions:
            return
        self._functions.add(id(func))
        g = func.__globals__
        # A module's functions share its globals: the dict is walked again only from a shallower depth (from which
        # its functions reach further); a module of F functions and G globals costs G per capture, not F x G. Its
        # tensors and modules are named before the functions found there are walked (their closures' names second).
        module = func.__module__
        if self._globals.get((id(g), module), depth + 1) > depth:
            self._globals[id(g), module] = depth
            functions = []
            for key, value in list(g.items()):
                if isinstance(value, (torch.Tensor, torch.nn.Module)):
                    self._add_root(value, key, Item(Absolute(g, "globals"), key), depth)
                elif isinstance(value, types.FunctionType) and value.__module__ == module:
                    functions.append((key, value))
            for key, value in functions:
                self._add_root(value, key, Item(Absolute(g, "globals"), key), depth)
        for var, cell in zip(func.__code__.co_freevars, func.__closure__ or ()):
            with contextlib.suppress(ValueError):
                self._add_root(cell.cell_contents, var, Attr(Absolute(cell, f"closure[{var!r}]"), "cell_contents"),
                               depth)

    def _walk(self, module: torch.nn.Module, prefix: str, root: Source, path: str = "") -> None:
        d = module.__dict__
        found = self._found
        same = prefix is path  # (the root module's tree: each name is its path, one string for both)
        for group in (d.get("_parameters"), d.get("_buffers")):
            if group:
                for key, value in group.items():
                    if isinstance(value, torch.Tensor) and id(value) not in found:
                        name = prefix + key
                        found[id(value)] = (name, root, name if same else path + key)
        # Tensor attributes, in the module's attribute order: only the names nn.Module does not set itself can
        # hold one (a set difference in C; a deep model has thousands of modules). A tensor by its class (a real
        # tensor's is a subclass of Tensor; isinstance would also ask the value's `__class__`, which a config's own
        # __getattribute__ answers in Python, ~2 us for each module holding the config; no lifted tensor is an
        # object that only claims to be one)
        extra = d.keys() - _MODULE_FIELDS
        for key in extra:
            if issubclass(type(d[key]), _Tensor):
                for key, value in d.items():
                    if key in extra and issubclass(type(value), _Tensor) and not key.startswith("__"):
                        self._add(value, prefix + key, root, path + key)
                break
        modules = d.get("_modules")
        if modules:
            for key, child in modules.items():
                if child is not None:
                    inner = f"{prefix}{key}."
                    self._walk(child, inner, root, inner if same else f"{path}{key}.")

    def _walk_object(self, obj: Any, label: str, root: Source, path: str, depth: int) -> None:
        """Tensors held by an input object's attributes, and the lists and dicts it holds (a dataclass batch,
        a KV cache: `past_key_values.layers[0].keys`)."""
        if isinstance(obj, torch.nn.Module):
            self._walk(obj, f"{label}.", root, path)
            return
        if depth >= config.names_max_depth:
            return
        source = module_path(root, path.rstrip("."))
        if isinstance(obj, (list, tuple, dict)):
            items = obj.items() if isinstance(obj, dict) else enumerate(obj)
            for key, value in items:
                self._object_item(value, f"{label}[{key!r}]", Item(source, key), depth)
            return
        fields = getattr(obj, "__dict__", None)
        if not isinstance(fields, dict):
            return
        for key, value in list(fields.items()):
            if isinstance(value, torch.Tensor):
                self._add(value, f"{label}.{key}", root, path + key)
            elif isinstance(value, (list, tuple, dict)) or (hasattr(value, "__dict__") and not isinstance(value, type)):
                self._walk_object(value, f"{label}.{key}", root, f"{path}{key}.", depth + 1)

    def _object_item(self, value: Any, label: str, source: Source, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            if id(value) not in self._found:
                self._found[id(value)] = (label, source, None)
        elif isinstance(value, (list, tuple, dict)) or (hasattr(value, "__dict__") and not isinstance(value, type)):
            self._walk_object(value, label, source, "", depth + 1)

    def find(self, t: torch.Tensor) -> tuple[str, Source] | None:
        """(placeholder name, source relative to `[fn, *inputs]`) of a named tensor, or None."""
        hit = self._found.get(id(t))
        if hit is None:
            return None
        name, root, path = hit
        return name, root if path is None else self._source(root, path.rstrip("."))

    def _source(self, root: Source, path: str) -> Source:
        """`module_path(root, path)`, sharing the sources of the modules above it (a layer's parameters are
        found one after another; sources are immutable)."""
        owner, _, attr = path.rpartition(".")
        if not owner:
            return module_path(root, path)
        key = (id(root), owner)
        parent = self._owners.get(key)
        if parent is None:
            parent = self._owners[key] = self._source(root, owner)
        return Attr(parent, attr)
