"""What one region trace read through the code it ran: the defaults and closure cells of its functions, the
globals and `module.attr` chains their code loads (guarded, or noted by identity in one NamespaceReads), and the
closures it cannot reach (ineligible). Bytecode facts come from trace/code.py.
"""

from __future__ import annotations

import builtins
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any

from ..guards.guard import Kind
from ..guards.namespaces import ABSENT_NAME, TENSOR_DICT, NamespaceReads
from ..guards.values import immutable_constant
from ..sources import MISSING, Absolute, Attr, Closure, FnAttr, Global, Item, Source
from ..trace.code import code_facts, is_user_file, is_user_module
from ..watch.classpatch import PATCHED_NAMES
from .objects import by_name, ours


class FrameCode:
    """The code part of a RegionFrame: its attributes are set in `_begin_code`."""

    # the host's (RegionFrame), read here
    fn: Callable
    global_stores: list[tuple[dict, str]]
    writes: list[str]
    guard: Callable[..., None]
    adopt: Callable[..., None]
    adopt_class_value: Callable[..., None]
    _note_container: Callable[..., None]
    mark_ineligible: Callable[..., None]

    def _begin_code(self) -> None:
        self._functions: set[types.CodeType] = set()  # codes whose globals (and cells, if known) are guarded
        self._local_codes: set[types.CodeType] = set()  # functions defined while tracing (closures over locals)
        self._guarded_code: set[tuple[types.CodeType, int]] = set()
        self._super_mros: set[tuple[types.CodeType, tuple]] = set()  # (see _guard_super_reads)
        self._ran: set[types.CodeType] = set()  # user code that ran in this trace
        self._adopted: dict[int, Callable] = {}  # functions whose cells and defaults are guarded
        self.cells_read: list[tuple[Any, Callable, Any]] = []  # (closure cell, its function, what it held when
        # read) of functions reached as values: a cell the program rebinds (`nonlocal`) is user state
        self._methods: dict[types.CodeType, list[tuple[Callable, Source]]] = {}  # functions guarded by identity
        # alone so far (where each was found): their code, defaults and cells are guarded once that code runs
        self.namespaces = NamespaceReads()  # module attributes and Tensor methods, by identity
        self._imports_pending: list[tuple] = []  # imports of modules not imported yet: guarded at the trace's end
        self.namespaces.note_whole(TENSOR_DICT, "torch.Tensor")

    def adopt_function(self, fn: Callable, as_source: Source | None) -> None:
        """Guard the defaults and closure cells of a function whose code may run (`as_source=None`: the
        region's own function, whose cells and defaults are resolved from each call's function)."""
        code = getattr(fn, "__code__", None)
        if code is None or id(fn) in self._adopted:
            return  # (functions with one code and other cells, like closures made per layer, each count)
        self._adopted[id(fn)] = fn
        self._functions.add(code)
        where = f"defaults of {code.co_qualname}"
        for attr in ("__defaults__", "__kwdefaults__"):  # a default the call did not pass is read too
            default = getattr(fn, attr, None)
            if default is not None:
                source = FnAttr(attr) if as_source is None else Attr(as_source, attr)
                self.adopt(default, source, where=where)
        closure = getattr(fn, "__closure__", None) or ()
        for i, var in enumerate(code.co_freevars):
            try:
                value = closure[i].cell_contents
            except (IndexError, ValueError):
                continue
            cell = (Closure(i, var) if as_source is None
                    else Attr(Item(Attr(as_source, "__closure__"), i), "cell_contents"))
            if as_source is not None:
                self.cells_read.append((closure[i], fn, value))
            self.adopt(value, cell, where=f"closure of {code.co_qualname}")
            if isinstance(value, types.ModuleType):  # (`sys.modules.get(..)`, `cfg.FLAG` through a cell: as a global's)
                self._adopt_module_chains(value, cell, var, code_facts(code).cell_chains, f"closure of "
                                          f"{code.co_qualname}")
        if as_source is None:
            self.on_code(code, fn.__globals__, own=True, fn=fn)

    def _adopt_callable(self, fn: types.FunctionType, source: Source, where: str, fields: bool = True) -> None:
        """A Python function: a region wrapper by its innermost function, others by identity, and in both
        cases the closure cells and defaults its code reads."""
        marked = getattr(fn, "__stampout_region__", None)
        if marked is not None:  # one wrapper per marked instance, all with the same code and function
            self.guard(Attr(source, "__code__"), Kind.ID, fn.__code__, where)
            self._adopt_callable(marked.fn, Attr(Attr(source, "__stampout_region__"), "fn"), where,
                                 fields=bool(vars(marked.fn)))
            return
        self.guard(source, Kind.ID, fn, where)
        self._defer(fn, source)
        if fields and is_user_file(fn.__code__.co_filename):
            # Its attributes (`helper.k = 3.0`, read as `helper.k` or `getattr(helper, "k", 1)`: no watch sees it)
            attrs = Attr(source, "__dict__")
            self.guard(attrs, Kind.KEYS, tuple(vars(fn)), where)
            for k, v in list(vars(fn).items()):
                if not k.startswith("__"):
                    self.adopt(v, Item(attrs, k), where=where)
            self._note_container(vars(fn), attrs, where)  # (`log.last = n` in the trace: a store to replay)

    def note_by_identity(self, namespace: dict, label: str, name: str, value: Any, source: Source) -> bool:
        """A class attribute or a helper's global guarded by identity alone, in the NamespaceReads (one dict-version
        check per namespace, however many names: a class of transformers defines hundreds): a function, or a
        property, staticmethod or classmethod of functions, or an immutable constant. A function's code, defaults
        and cells are guarded when its code runs in this trace (a method that never runs changed nothing). False
        for anything else (a class, a container, stampout's own region wrappers): adopted as a value."""
        if type(value) in (property, staticmethod, classmethod):
            if any(not k.startswith("__") for k in getattr(value, "__dict__", None) or ()):
                return False
            parts = [(getattr(value, p, None), p) for p in (("fget", "fset", "fdel") if type(value) is property
                                                            else ("__func__",))]
            if not all(fn is None or type(fn) is types.FunctionType for fn, _ in parts):
                return False
            functions = [(fn, Attr(source, part)) for fn, part in parts if fn is not None]
        elif type(value) is types.FunctionType:
            if ours(value) or getattr(value, "__stampout_region__", None) is not None:
                return False
            functions = [(value, source)]
        elif immutable_constant(value):
            functions = []
        else:
            return False
        self.namespaces.note(namespace, label, name, value)
        for fn, at in functions:
            self._defer(fn, at)
        return True

    def _defer(self, fn: types.FunctionType, source: Source) -> None:
        """A user function found at `source`, guarded by identity: its code (`f.__code__ = g.__code__`), defaults
        and cells are guarded now if that code ran in this trace already, else when it runs (every function found
        with that code then: closures made per layer share one)."""
        code = fn.__code__
        if not is_user_file(code.co_filename):
            return
        if code in self._ran:
            self.guard(Attr(source, "__code__"), Kind.ID, code, f"code of {code.co_qualname}")
            self.adopt_function(fn, source)
            return
        found = self._methods.setdefault(code, [])
        if not any(f is fn for f, _ in found):
            found.append((fn, source))

    def adopt_descriptor(self, value: property | staticmethod | classmethod, source: Source, where: str) -> None:
        """A property, staticmethod or classmethod (found on a class): by identity (its functions are read-only
        fields of it), and the code of the functions it runs as a function's: `__code__`, defaults, closure cells.
        A subclass may keep more state than these: fields of its own (not the dunders a staticmethod copies from
        its function) are refused."""
        self.guard(source, Kind.ID, value, where)
        if any(not k.startswith("__") for k in getattr(value, "__dict__", None) or ()):
            self.mark_ineligible(f"reads {source.name()}, a {type(value).__name__} with attributes of its own")
        parts = ("fget", "fset", "fdel") if isinstance(value, property) else ("__func__",)
        for part in parts:
            fn = getattr(value, part, None)
            if isinstance(fn, types.FunctionType) and is_user_file(fn.__code__.co_filename):
                self.guard(Attr(Attr(source, part), "__code__"), Kind.ID, fn.__code__, where)
                self.adopt_function(fn, Attr(source, part))
            elif fn is not None and not isinstance(fn, types.FunctionType):
                self.adopt(fn, Attr(source, part), where=where)

    def on_code(self, code: types.CodeType, g: dict, own: bool = False, where: str = "",
                frame: types.FrameType | None = None, fn: Callable | None = None) -> None:
        """Python code is about to run in this trace: guard the globals it may read (and `module.attr`
        chains), record the globals it assigns, and refuse closures this frame cannot reach."""
        self._ran.add(code)
        found = self._methods.pop(code, ())
        if len(found) > 1 and code.co_freevars and (fn is not None or frame is not None):  # (one decorator's
            # wrapper, around many functions: the one running)
            running = [(f, at) for f, at in found if f is fn or fn is None and _same_cells(f, frame.f_locals)]
            self._methods[code] = [(f, at) for f, at in found if all(f is not r for r, _ in running)]
            found = running  # (none: the one running was found otherwise, or its cells are refused below)
        for f, source in found:  # (guarded by identity so far: it runs, so all of it)
            self._defer(f, source)
        facts = code_facts(code)
        if facts.super_reads:  # (less the names stampout's attribute watch patches: as _adopt_class leaves them)
            self._guard_super_reads(code, tuple(n for n in facts.super_reads if n not in PATCHED_NAMES), frame, fn)
        key = (code, id(g))
        if key in self._guarded_code:
            return
        self._guarded_code.add(key)
        self._local_codes.update(facts.nested)
        free = [v for v in code.co_freevars if v != "__class__"]
        if free and code not in self._functions and code not in self._local_codes:
            self.mark_ineligible(
                f"runs {code.co_qualname}, a closure over {', '.join(free)} that stampout cannot reach"
            )
        # (`object.__getattribute__(obj, name)`: a slot wrapper, no C-call event, around the watched class's own
        # lookup; `super().__getattribute__` skips its shim. Not in a class's own `__getattribute__`, a config's
        # alias table: it runs inside the watched lookup, which reports the value it returns, guarded by reading
        # it again through it)
        if "__getattribute__" in code.co_names and code.co_name != "__getattribute__":
            self.mark_ineligible(f"reads attributes through __getattribute__ in {code.co_qualname} (a read no watch "
                                 "sees)")
        label = f"{g.get('__name__', '?')}.globals"
        own = own or (g is getattr(self.fn, "__globals__", None))
        where = where or f"global of {code.co_qualname}"
        builtin = _builtins_of(g)
        for name in facts.names:
            if name in g:
                value = g[name]
                source = Global(name) if own else Item(Absolute(g, label), name)
                if isinstance(value, types.ModuleType):
                    self._adopt_module_chains(value, source, name, facts.chains, where)
                    if name in facts.escapes:
                        self._note_user_namespace(value)
                elif own or not self.note_by_identity(g, label, name, value, source):  # (a helper's global)
                    self.adopt(value, source, where=where)
            elif name in builtin:  # (a builtin as found: `builtins.GAIN = 3` changes what the code loads, and so
                # does a global of that name defined later: `abs = my_abs` in the code's module)
                self.namespaces.note(builtin, "builtins", name, builtin[name])
                self.namespaces.note_lookup(g, label, name, ABSENT_NAME)
        for local, name, level, taken in facts.imports:
            self._adopt_import(local, name, level, taken, g, facts.import_chains, f"import in {code.co_qualname}")
        for chain in facts.attribute_stores:  # neither a stamped nor a compiled call would store it again
            if isinstance(g.get(chain[0]), types.ModuleType):
                self.mark_ineligible(f"stores {'.'.join(chain)} in a module's namespace (at {code.co_qualname}), "
                                     "a Python side effect stampout does not replay")
        for chain in facts.imported_stores:
            self.mark_ineligible(f"stores {'.'.join(chain)} on what an import in {code.co_qualname} returned (a "
                                 "module's namespace: a Python side effect stampout does not replay)")
        for name in facts.stores:
            self.global_stores.append((g, name))
            self.writes.append(f"global {name} (assigned by {code.co_qualname})")
            self.mark_ineligible(f"assigns the global {name} (a Python side effect stampout does not replay)")

    def _guard_super_reads(self, code: types.CodeType, names: tuple[str, ...], frame: types.FrameType | None,
                           fn: Callable | None) -> None:
        """`super().forward(x)` looks `forward` up along the MRO past the class whose method runs, through no watch
        (the super object's own lookup; nn.Linear's `forward` is not a user class's, whose dicts are guarded whole):
        each such name in every class of that MRO (the running instance's type's, where the frame shows it, and the
        method's class's, its `__class__` cell) as it holds it now, present or absent, checked by key per call."""
        mros = []
        if frame is not None and code.co_argcount:
            me = frame.f_locals.get(code.co_varnames[0])
            mros.append(me.__mro__ if isinstance(me, type) else type(me).__mro__)  # (a classmethod's cls too)
        if "__class__" in code.co_freevars:
            owner = frame.f_locals.get("__class__") if frame is not None else None
            cells = getattr(fn, "__closure__", None)
            if owner is None and cells:
                try:
                    owner = cells[code.co_freevars.index("__class__")].cell_contents
                except ValueError:
                    owner = None
            if isinstance(owner, type):
                mros.append(owner.__mro__)
        for mro in mros:
            if (code, mro) not in self._super_mros:
                self._super_mros.add((code, mro))
                for klass in mro:
                    if klass is not object:
                        self._guard_class_lookups(klass, names)

    def on_library_code(self, code: types.CodeType, g: dict) -> None:
        """torch.nn's module code is about to run (`nn.GELU.forward` calls `F.gelu`): the functions, classes and
        modules it reaches through its globals are guarded by identity, in the NamespaceReads."""
        key = (code, id(g))
        if key in self._guarded_code:
            return
        self._guarded_code.add(key)
        facts = code_facts(code)
        label = g.get("__name__", "?")
        for name in facts.names:
            value = g.get(name, MISSING)
            if value is MISSING or not _library_read(value):
                continue
            self.namespaces.note(g, label, name, value)
            if isinstance(value, types.ModuleType):
                for chain in facts.chains:
                    if chain[0] == name:
                        self._note_chain(value, chain[1:])

    def _adopt_import(self, local: str, name: str, level: int, taken: str | None, g: dict,
                      chains: tuple[tuple[str, ...], ...], where: str, last: bool = False) -> None:
        """`import m` / `from m import x` in the code: the import reads `sys.modules` (the world), so what it binds
        is guarded there (by identity) and what the code reads off it as off a global (`m.FLAG`). A module not
        imported yet is guarded at the trace's end (`last`: close_imports), once the code imported it."""
        try:
            full = importlib.util.resolve_name("." * level + name, g.get("__package__")) if level else name
        except (ImportError, ValueError, TypeError):
            full = None
        value = sys.modules.get(full, MISSING) if full else MISSING
        source: Source = Item(Absolute(sys.modules, "sys.modules"), full)
        if value is MISSING and full and not last:
            self._imports_pending.append((local, name, level, taken, g, chains, where))
            return
        if value is MISSING and full:  # (an import the trace did not run: absent still)
            self.guard(source, Kind.ABSENT, MISSING, where)
            return
        if value is not MISSING and taken is not None:  # (`from m import x`: m's x, or its submodule m.x)
            value = getattr(value, taken, sys.modules.get(f"{full}.{taken}", MISSING))
            source = Attr(source, taken)
        if value is MISSING:
            self.mark_ineligible(f"imports {full or name} ({where}): what it binds is not known")
        elif isinstance(value, types.ModuleType):
            self._adopt_module_chains(value, source, local, chains, where)
            self._note_user_namespace(value)
        else:
            self.adopt(value, source, where=where)

    def close_imports(self) -> None:
        """At the trace's end: the imports of modules that were not imported when their code started."""
        pending, self._imports_pending = self._imports_pending, []
        for args in pending:
            self._adopt_import(*args, last=True)

    def _note_user_namespace(self, module: types.ModuleType) -> None:
        """A user's module used as a value (`getattr(cfg, name)`, `self.cfg_module.SCALE`): every name in it is
        guarded by identity (one dict-version check per call), since no bytecode chain says which are read."""
        if is_user_module(module):
            self.namespaces.note_whole(module.__dict__, module.__name__)

    def _note_chain(self, module: types.ModuleType, attrs: tuple[str, ...]) -> None:
        for attr in attrs:
            found = module.__dict__.get(attr, MISSING)
            if found is MISSING or not _library_read(found):
                return
            self.namespaces.note(module.__dict__, module.__name__, attr, found)
            if not isinstance(found, types.ModuleType):
                return
            module = found

    def _adopt_module_chains(self, module: types.ModuleType, source: Source, name: str,
                             chains: tuple[tuple[str, ...], ...], where: str) -> None:
        """`F.gelu`, `torch.nn.functional.gelu`, `cfg.FLAG` through a module global: the module itself by
        identity, and each attribute reached. Modules, classes, builtins and library functions found in a
        module's `__dict__` are guarded by identity through one NamespaceReads (dict versions: a fixed cost per
        call however many names); other values (a config constant, a user function) by their own guards."""
        self.guard(source, Kind.ID, module, where)
        for chain in chains:
            if chain[0] != name:
                continue
            value: Any = module
            src = source
            for attr in chain[1:]:
                if not isinstance(value, types.ModuleType):
                    break
                namespace = value.__dict__
                found = getattr(value, attr, MISSING)
                src = Attr(src, attr)
                if ours(found):
                    break  # stampout's stand-in while capturing (`torch.compiler.is_compiling`)
                if attr in namespace and namespace[attr] is found and by_name(found):
                    self.namespaces.note(namespace, value.__name__, attr, found)
                    if isinstance(found, type):  # (`usub.Thing().val`: what its class holds, as a class value's)
                        self.adopt_class_value(found, where)
                else:
                    self.adopt(found, src, where=where)
                    break
                value = found


def _builtins_of(g: dict) -> dict:
    """The builtins a function with globals `g` loads names from (`__builtins__`: a dict, or the module in __main__)."""
    found = g.get("__builtins__", builtins.__dict__)
    return found.__dict__ if isinstance(found, types.ModuleType) else found if isinstance(found, dict) else {}


def _same_cells(fn: types.FunctionType, local: dict) -> bool:
    """Whether `fn`'s closure cells hold what the running frame's free variables (in `local`) hold: `fn` is the
    function of that frame, among others with its code. (The frame's locals at its call event may lack some.)"""
    compared = False
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        if name not in local:
            continue
        try:
            if cell.cell_contents is not local[name]:
                return False
        except ValueError:  # (an empty cell)
            return False
        compared = True
    return compared


def _library_read(value: Any) -> bool:
    """Whether a name torch.nn's code reads is guarded by identity: what `by_name` guards, and a user's function put
    in a library function's place (`F.gelu = my_gelu`: traced as user code, but the name itself was left unguarded,
    so the original put back later ran the user's function's trace)."""
    return by_name(value) or (isinstance(value, types.FunctionType) and not ours(value))
