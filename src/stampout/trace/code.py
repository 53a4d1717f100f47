"""What a code object can read and write by name: its globals, `module.attr` chains, global stores."""

from __future__ import annotations

import dis
import importlib.metadata
import os
import re
import sys
import sysconfig
import types
from dataclasses import dataclass
from typing import Any

import torch

from .. import caches, config

_OWN_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)
_STDLIB_DIRS = tuple(dict.fromkeys(
    [os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")]
    + [sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib")]
))
_INSTALLED = tuple(os.sep + name + os.sep for name in ("site-packages", "dist-packages"))
_LOADS_ATTR = ("LOAD_ATTR", "LOAD_METHOD")
_HEAP_TYPE = 1 << 9  # (Py_TPFLAGS_HEAPTYPE: a class made by a class statement or `type(...)`, not a C one)
_TOOLS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools") + os.sep  # the zoo: user code
# Python's, stampout's and FX's generated code
_GENERATED = ("<frozen", "<stampout guards>", "<eval_with_key", "<torch", "<string>")


@dataclass(frozen=True)
class CodeFacts:
    names: tuple[str, ...]  # names it may load as globals (attribute names included: a superset)
    chains: tuple[tuple[str, ...], ...]  # `g.a.b` loads: global name, then attributes
    stores: tuple[str, ...]  # globals it assigns or deletes
    attribute_stores: tuple[tuple[str, ...], ...]  # `g.a.b = v` / `del g.a.b`: global name, attributes, stored one
    nested: tuple[types.CodeType, ...]  # code objects of functions it defines
    escapes: tuple[str, ...] = ()  # globals it loads as values, not only to read an attribute of them
    imported_stores: tuple[tuple[str, ...], ...] = ()  # `import m` in the function, then `m.a = v`: local name,
    # attributes, stored one (a store into what an import returns: a module, or an object a module holds)
    cell_chains: tuple[tuple[str, ...], ...] = ()  # `c.a.b` loads from a closure cell: its name, then attributes
    imports: tuple[tuple[str, str, int, str | None], ...] = ()  # a local an import binds: (local, module as
    # imported, level, the name taken from it or None): `import a.b` binds sys.modules["a"], `import a.b as c` and
    # `from a import b` (a module or a value) what FrameCode._adopt_import resolves
    import_chains: tuple[tuple[str, ...], ...] = ()  # `m.a.b` loads from a local an import bound
    super_reads: tuple[str, ...] = ()  # attributes loaded from what a `super(...)` call returned (a superset: any
    # attribute loaded right after a call made between loading `super` and the end of that expression)


_FACTS: dict[types.CodeType, CodeFacts] = caches.register({}, "trace.code facts")
_USER_FILES: dict[str, bool] = caches.register({}, "trace.code user files")
_USER_FILES_WATCHING: dict[str, bool] = caches.register({}, "trace.code user files, installed packages watched")


def is_user_file(filename: str) -> bool:
    """Code outside torch, stampout and the standard library: a user's files and code made by `exec` (whose file
    is `<...>`). Installed packages (site-packages, dist-packages: transformers, diffusers, a package of the
    user's) with `config.watch_installed`, but torch's own distribution and what it requires (sympy, jinja2, ...:
    torch's machinery, called while tracing): an installed package keeps memo caches, registries and globals as a
    user's file does (a venv's `platstdlib` holds site-packages: the path's shape decides). Without the switch,
    what lies under the standard library's folders (a venv's site-packages) is library code."""
    known = _USER_FILES_WATCHING if config.watch_installed else _USER_FILES
    user = known.get(filename)
    if user is None:
        user = known[filename] = _is_user_file(filename, config.watch_installed)
    return user


def _is_user_file(filename: str, installed: bool) -> bool:
    if filename.startswith(_GENERATED):
        return False
    if filename.startswith(_TOOLS):
        return True
    if filename.startswith(_OWN_DIRS):
        return False  # (torch, stampout: wherever they are installed)
    if installed and any(part in filename for part in _INSTALLED):
        return not filename.startswith(_torch_distributions())
    return not filename.startswith(_STDLIB_DIRS)


@caches.memo
def _torch_distributions() -> tuple[str, ...]:
    """The folders and files of torch's distribution and its required distributions, transitively (not its
    extras): installed code torch runs as its own (sympy for symbolic sizes, jinja2 for Inductor's templates)."""
    return _distribution_roots("torch")


def _distribution_roots(name: str) -> tuple[str, ...]:
    roots: dict[str, None] = {}
    seen: set[str] = set()
    todo = [name]
    while todo:
        wanted = todo.pop()
        key = re.sub(r"[-_.]+", "-", wanted).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = importlib.metadata.distribution(wanted)
        except importlib.metadata.PackageNotFoundError:
            continue
        for top in _top_level(dist):
            for path in (str(dist.locate_file(top)), os.path.realpath(dist.locate_file(top))):
                roots[path + os.sep] = None
                roots[path + ".py"] = None
        for requirement in dist.requires or ():
            if "extra" not in requirement.partition(";")[2]:
                todo.append(re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0])
    return tuple(roots)


def _top_level(dist: importlib.metadata.Distribution) -> list[str]:
    """The names a distribution installs at the top of site-packages: its top_level.txt (torch's RECORD lists
    15,000 files: reading it costs a capture a quarter second), else the first parts of its files."""
    listed = dist.read_text("top_level.txt")
    if listed:
        return [line.strip() for line in listed.splitlines() if line.strip()]
    tops = {file.parts[0].removesuffix(".py") for file in dist.files or () if file.parts}
    return sorted(t for t in tops if t not in ("..", "__pycache__") and not t.endswith(
        (".dist-info", ".egg-info", ".data", ".pth")))


def module_file(module: types.ModuleType | None) -> str | None:
    """A module's `__file__`, read from its `__dict__` (not getattr: a module's own `__getattr__` may raise
    anything, or make something up), or None."""
    fields = getattr(module, "__dict__", None)
    return fields.get("__file__") if type(fields) is dict else None


def is_user_class(klass: type) -> bool:
    """A class of user code: its module's file is user code, or its module has no file or is not imported (a
    class made by `exec` or `type(...)`). Not a class defined in C (`object`, `BaseException`: no Python made it,
    and its namespace cannot be written)."""
    return bool(klass.__flags__ & _HEAP_TYPE) and is_user_file(module_file(sys.modules.get(klass.__module__))
                                                                or "<module>")


def is_user_module(module: types.ModuleType | None) -> bool:
    """A module of the user's (a config module, one made with `types.ModuleType`), not a library's or a
    builtin one (`sys`: no file, but imported): its namespace holds values the program may read and change
    between calls. The one definition: the guards on a module used as a value and the world snapshot ask it."""
    if module is None:
        return False
    file = module_file(module)
    if file is None:
        fields = getattr(module, "__dict__", None)
        if type(fields) is not dict:
            return False
        spec = fields.get("__spec__")
        if spec is None:
            return True  # (made by code, not imported)
        builtin = fields.get("__name__") in sys.builtin_module_names
        if builtin or getattr(spec, "origin", None) in ("built-in", "frozen"):
            return False  # (sys, itertools: the interpreter's own)
        # A namespace package is its folders' (a user's or a library's); a module made from a spec without a
        # loader (`importlib.util.module_from_spec`) was made by code: a user's.
        folders = getattr(spec, "submodule_search_locations", None)
        return not folders or any(isinstance(f, str) and is_user_file(os.path.join(f, "")) for f in folders)
    return isinstance(file, str) and is_user_file(file)


def is_user_code(code: types.CodeType) -> bool:
    """User code, less the methods the standard library generates with `exec` (dataclass `__init__`)."""
    return is_user_file(code.co_filename) and not code.co_qualname.startswith("__create_fn__")


def code_facts(code: types.CodeType) -> CodeFacts:
    facts = _FACTS.get(code)
    if facts is None:
        facts = _FACTS[code] = _analyse(code)
    return facts


def _analyse(code: types.CodeType) -> CodeFacts:
    chains: list[tuple[str, ...]] = []
    stores: list[str] = []
    attribute_stores: list[tuple[str, ...]] = []
    escapes: list[str] = []
    chain: list[str] | None = None
    cell: list[str] | None = None  # (`mod.attr = v` with `mod` a closure cell: only its stores are kept)
    imported: set[str] = set()  # locals an import statement bound
    imported_stores: list[tuple[str, ...]] = []
    cell_chains: list[tuple[str, ...]] = []
    imports: list[tuple[str, str, int, str | None]] = []
    import_chains: list[tuple[str, ...]] = []
    consts: list[Any] = [None, None]
    importing: tuple[str, int, Any] | None = None  # the IMPORT_NAME being bound: (name, level, fromlist)
    taken: str | None = None  # the name its last IMPORT_FROM took
    previous = None
    augmented: tuple[list, tuple[str, ...]] | None = None  # (`g.a.n += 1`: COPY of the chain, then its store)
    super_reads: list[str] = []
    in_super: bool | str = False  # (after `super` loaded, to the end of its expression; "called": after a call)
    for ins in dis.get_instructions(code):
        if in_super == "called" and ins.opname in _LOADS_ATTR:
            super_reads.append(ins.argval)
        if in_super:
            in_super = ("called" if ins.opname == "CALL" else
                        False if ins.opname.startswith(("STORE_", "RETURN_", "POP_TOP")) else True)
        if ins.opname == "LOAD_GLOBAL" and ins.argval == "super":
            in_super = True
        if ins.opname == "LOAD_CONST":
            consts = [consts[-1], ins.argval]
        elif ins.opname == "IMPORT_NAME":
            importing, taken = (ins.argval, consts[0] if type(consts[0]) is int else 0, consts[1]), None
        elif ins.opname == "IMPORT_FROM":
            taken = ins.argval
        if ins.opname in ("STORE_FAST", "STORE_DEREF") and previous in ("IMPORT_NAME", "IMPORT_FROM"):  # (a cell:
            # `import m` in a function whose nested function reads m)
            imported.add(ins.argval)
            if importing is not None:
                name, level, fromlist = importing
                if previous == "IMPORT_NAME":  # (`import a.b`: the top package; `from a import *` stores nothing)
                    imports.append((ins.argval, name if level or fromlist else name.partition(".")[0], level, None))
                else:  # (`import a.b as c`: the module a.b; `from a import b`: a's b)
                    imports.append((ins.argval, name, level, taken if fromlist is not None else None))
        previous = ins.opname
        if ins.starts_line is not None:
            augmented = None
        if ins.opname == "COPY" and ins.arg == 1 and (chain is not None or cell is not None):
            target = chain if chain is not None else cell
            augmented = (attribute_stores if chain is not None or target[0] not in imported else imported_stores,
                         tuple(target))
        elif augmented is not None and ins.opname in ("STORE_ATTR", "DELETE_ATTR"):
            augmented[0].append((*augmented[1], ins.argval))
            augmented = None
        if ins.opname in ("LOAD_FAST", "LOAD_DEREF") and ins.argval in imported:
            cell = [ins.argval]
        elif ins.opname == "LOAD_DEREF" and ins.argval in code.co_freevars:
            cell = [ins.argval]
        elif cell is not None and ins.opname in _LOADS_ATTR and len(cell) < 4:
            cell.append(ins.argval)
        else:
            if cell is not None and ins.opname in ("STORE_ATTR", "DELETE_ATTR"):
                (imported_stores if cell[0] in imported else attribute_stores).append((*cell, ins.argval))
            elif cell is not None and len(cell) > 1:
                (import_chains if cell[0] in imported else cell_chains).append(tuple(cell))
            cell = None
        if chain is not None and len(chain) == 1 and ins.opname not in _LOADS_ATTR:
            escapes.append(chain[0])  # (`getattr(cfg, name)`, `return cfg`: any attribute may be read)
        if ins.opname == "LOAD_GLOBAL":
            if chain is not None and len(chain) > 1:
                chains.append(tuple(chain))
            chain = [ins.argval]
            continue
        if chain is not None and ins.opname in _LOADS_ATTR and len(chain) < 4:
            chain.append(ins.argval)
            continue
        if chain is not None and len(chain) > 1:
            chains.append(tuple(chain))
        if chain is not None and ins.opname in ("STORE_ATTR", "DELETE_ATTR"):
            attribute_stores.append((*chain, ins.argval))
        chain = None
        if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            stores.append(ins.argval)
    if chain is not None and len(chain) > 1:
        chains.append(tuple(chain))
    elif chain is not None:
        escapes.append(chain[0])
    nested = tuple(c for c in code.co_consts if isinstance(c, types.CodeType))
    return CodeFacts(tuple(dict.fromkeys(code.co_names)), tuple(dict.fromkeys(chains)), tuple(stores),
                     tuple(dict.fromkeys(attribute_stores)), nested, tuple(dict.fromkeys(escapes)),
                     tuple(dict.fromkeys(imported_stores)), tuple(dict.fromkeys(cell_chains)), tuple(imports),
                     tuple(dict.fromkeys(import_chains)), tuple(dict.fromkeys(super_reads)))


def user_hashed(key: Any) -> bool:
    """A dict key whose `__hash__` or `__eq__` is the user's Python: stampout's own lookups, copies and fingerprints
    of the dict would call it, calls eager never makes (a counting `__hash__` counts them)."""
    cls = type(key)
    return any(isinstance(f, types.FunctionType) and is_user_file(f.__code__.co_filename)
               for f in (getattr(cls, "__hash__", None), getattr(cls, "__eq__", None)))


def user_hashed_key(d: dict) -> Any:
    """The first key of dict `d` (as dict stores them) whose `__hash__` or `__eq__` is the user's Python, or None."""
    return next((k for k in dict.keys(d) if type(k) is not str and user_hashed(k)), None)
