"""Which C calls a traced program may make: an allowlist of callables known to be pure.

A trace runs the program's Python once; a call whose result is not a function of what the guards see
(`random.random()`, `time.time()`, `os.urandom`, a `random.Random` method) would be baked into every reuse
and every compiled call. While region (or program) frames are open, a `sys.setprofile` hook sees each C call
made from user code and from the standard library's Python (so `random.randint`, Python calling the C
`getrandbits`, and `uuid.uuid4`, Python calling `os.urandom`, are caught too); a callable outside the allowlist
makes every open frame ineligible. Torch functions are allowed: they reach the TorchFunctionMode and are graph
nodes (their Python runs with the hook off). Cython callables (`numpy.random.*`) raise no C-call event: the
objects they are reached through (a `RandomState`, a cython function) have state stampout cannot guard, which
makes the trace ineligible when it reads them (see RegionFrame.adopt).

# Note: why an allowlist and not a list of known-impure functions
Fail closed: a C extension we have never heard of may keep state; it costs a trace (or an eager run), not a
wrong result. The allowlist covers what models call in forward: builtins without state, `math`, `operator`,
methods of plain containers, strings and numbers, torch and numpy (less their RNGs), and locks.
"""

from __future__ import annotations

import collections
import contextvars
import functools
import importlib
import logging
import os
import re
import sysconfig
import threading
import types
import weakref
from typing import Any

from .. import caches
from ..torch_internals import (
    Generator,
    InferenceMode,
    push_saved_tensors_default_hooks,
    set_default_dtype,
    set_deterministic_algorithms,
)
from ..trace.code import is_user_file
from ..trace.op_facts import saved_hooks_keep_values

_PURE_MODULES = frozenset({
    "builtins", "math", "cmath", "_operator", "operator", "_functools", "functools", "_collections", "_abc",
    "_weakref", "_heapq", "_bisect", "_struct", "_string", "_sre", "re", "_json", "binascii", "zlib",
    "unicodedata", "_codecs", "_thread", "sys", "_warnings", "_imp", "marshal", "itertools", "_hashlib", "_md5",
    "_sha1", "_sha256", "_sha512", "_sha3", "_blake2", "_contextvars", "_typing", "copyreg", "_pickle", "gc",
})
# Builtins with effects a compiled call would not repeat (I/O) or that read the outside world.
_IMPURE_BUILTINS = frozenset({"print", "input", "open", "breakpoint", "id",  # (id: an address, not a value)
                              "__import__",  # (what it returns is read from sys.modules: see IMPORTS_BY_NAME)
                              "eval", "exec"})  # (code of `<string>`, which no frame watches: the globals it reads)
_PURE_POSIX = frozenset({"fspath", "getpid", "fsencode", "fsdecode"})
_PURE_TYPES = frozenset({
    object, type, int, bool, float, complex, str, bytes, bytearray, memoryview, tuple, list, dict, set, frozenset,
    slice, range, type(None), types.SimpleNamespace, types.MappingProxyType, types.FunctionType, types.MethodType,
    types.CodeType, types.ModuleType, property, staticmethod, classmethod, collections.OrderedDict,
    collections.defaultdict, collections.deque, type({}.keys()), type({}.values()), type({}.items()), re.Pattern,
    re.Match, type(threading.Lock()), type(threading.RLock()), functools.partial, contextvars.ContextVar,
    contextvars.Token, weakref.ref, weakref.ProxyType, weakref.CallableProxyType, enumerate, zip, map, filter,
    reversed, type(iter([])), type(iter(())), type(iter("")),
})
_RNG_MODULES = ("numpy.random", "random", "_random")
# Methods of pure types whose result depends on hidden state no put-back restores: which member `set.pop` takes
# follows the set's earlier pops (its search finger survives `clear()`), so a trace's pop, undone by refilling the set,
# made the eager call that followed pop another member.
_HIDDEN_STATE_METHODS = frozenset({(set, "pop")})
_PYTHON_METHODS = (types.FunctionType, staticmethod, classmethod, property)
_torch_generator = Generator
_MODULE_VERDICTS: dict[Any, bool] = caches.register({}, "regions.purity function verdicts")
_METHOD_VERDICTS: dict[tuple[type, str], bool] = caches.register({}, "regions.purity method verdicts")


# torch's process-wide settings (threads, matmul precision, deterministic algorithms, the default dtype, anomaly
# mode, flush-denormal, the cudnn/cublas/mkldnn/sdp flags that torch.backends.* set): a setter's effect outlives the
# call, and a graph neither keeps nor repeats it. A torch C function is a setter by its name (`set_*`, `_set_*`),
# unless it sets what a graph keeps (grad mode, autocast: the tracer records them) or is torch's plumbing for one
# tensor or one dispatch (conj/neg bits, modes, tracing, functionalization, a thread's name).
_SETTER = re.compile(r"_?(un)?set_")
_KEPT_OR_PLUMBING = ("grad_enabled", "autocast", "conj", "neg", "torch_function", "dispatch", "tls", "tracing",
                     "functionalization", "tensor_metadata", "view_replay", "skip_next", "value_trace", "only_lift",
                     "thread_name", "worker_", "generator_metaclass", "eval_frame", "in_mode_without", "warn_")


def global_setter(module: str, name: str) -> bool:
    """Whether the torch C function `module.name` sets one of torch's process-wide settings (see above)."""
    return (module.split(".")[0] == "torch" and _SETTER.match(name) is not None
            and not module.startswith("torch._C._dynamo")  # (Dynamo's frame hooks, set and put back around calls)
            and not any(word in name for word in _KEPT_OR_PLUMBING))


# The interpreter's own state that functions of the pure modules above set or start, which outlives the call (a
# compiled call would not set it again): the garbage collector switched off, a thread started, a recursion limit.
_INTERPRETER_STATE = {
    "gc": frozenset({"enable", "disable", "freeze", "unfreeze", "set_threshold", "set_debug"}),
    "_thread": frozenset({"start_new_thread", "start_joinable_thread", "interrupt_main"}),
}


def _sets_interpreter_state(module: str, name: str) -> bool:
    return name in _INTERPRETER_STATE.get(module, ()) or module == "sys" and name.startswith(("set", "_set"))


def interpreter_state_call(fn: Any) -> bool:
    """Whether the C callable `fn` sets or starts interpreter state (see _INTERPRETER_STATE): checked from the quiet
    standard library too (`threading.Thread.start` starts its thread from threading.py)."""
    module = getattr(fn, "__module__", None)
    return isinstance(module, str) and _sets_interpreter_state(module, getattr(fn, "__name__", ""))


def _pure_module(module: str, name: str) -> bool:
    if _sets_interpreter_state(module, name):
        return False
    root = module.split(".")[0]
    if root == "torch":
        return not global_setter(module, name)
    if root == "numpy":
        return not module.startswith("numpy.random")
    if module == "builtins":
        return name not in _IMPURE_BUILTINS
    if module in ("posix", "os", "nt"):
        return name in _PURE_POSIX
    if module in ("_warnings", "warnings"):  # a warning each eager call shows (or a filter decides): not a value
        return not name.startswith("warn")
    return module in _PURE_MODULES


def _owner(cls: type, name: str) -> type:
    """The class that defines the C method `name` called on a `cls`: not a Python override of the same name
    (`super().get(key)` in a dict subclass's own `get` calls dict's)."""
    for klass in cls.__mro__:
        if name in klass.__dict__ and not isinstance(klass.__dict__[name], _PYTHON_METHODS):
            return klass
    return cls


def _pure_type(owner: type) -> bool:
    if owner in _PURE_TYPES:
        return True
    module = getattr(owner, "__module__", "") or ""
    if module.split(".")[0] == "torch":
        return not issubclass(owner, _torch_generator)
    return module.split(".")[0] == "numpy" and not module.startswith(_RNG_MODULES)


# Python that imports a module by a name it is given (`importlib.import_module(self.plugin)`, `importlib.__import__`):
# what it returns is read from `sys.modules`, behind every guard (an `import` statement's binding is guarded where
# the statement is, see FrameCode._adopt_import).
IMPORTS_BY_NAME = frozenset({importlib.import_module.__code__, importlib._bootstrap._gcd_import.__code__})
# Python of the quiet standard library that hands out an object its process-wide registry holds by name or thread
# (`logging.getLogger("x")`, `threading.current_thread()`): no source names it, so what traced code reads of it
# (`getLogger("x").factor`) would be baked and what it stores on it (`.last = h`) left a traced value there.
REGISTRY_LOOKUPS = frozenset({logging.getLogger.__code__, logging.Manager.getLogger.__code__,
                              logging.Logger.getChild.__code__, threading.current_thread.__code__,
                              threading.main_thread.__code__, threading.enumerate.__code__})


def impure_call(fn: Any) -> str | None:
    """None when `fn` (the callable of a 'c_call' profile event) is known pure; else how to name it."""
    name = getattr(fn, "__name__", "?")
    module = getattr(fn, "__module__", None)
    owner = getattr(fn, "__self__", None)
    if isinstance(module, str) or owner is None or isinstance(owner, types.ModuleType):
        if module is None:
            module = getattr(owner, "__name__", "?")
        try:
            pure = _MODULE_VERDICTS[fn]
        except (KeyError, TypeError):
            pure = _pure_module(module, name)
            try:
                _MODULE_VERDICTS[fn] = pure
            except TypeError:
                pass
        return None if pure else f"{module}.{name}"
    cls = owner if isinstance(owner, type) else type(owner)
    key = (cls, name)
    pure = _METHOD_VERDICTS.get(key)
    if pure is None:
        owner = _owner(cls, name)
        pure = _METHOD_VERDICTS[key] = _pure_type(owner) and (owner, name) not in _HIDDEN_STATE_METHODS
    return None if pure else f"{cls.__module__}.{cls.__qualname__}.{name}"


# Process-wide torch state torch's Python sets for the user, which a graph neither keeps nor sets again: default
# hooks on saved tensors (`saved_tensors_hooks`, `save_on_cpu`) change what backward computes with; inference mode
# makes inference tensors; the default dtype and deterministic switch outlive the call.
_TORCH_STATE = {
    push_saved_tensors_default_hooks: "torch.autograd.graph.saved_tensors_hooks",
    InferenceMode.__dict__["__enter__"].__func__: "torch.inference_mode",
    set_default_dtype: "torch.set_default_dtype",
    set_deterministic_algorithms: "torch.use_deterministic_algorithms",
}


# torch's C setters (by callable) and its Python that sets a process-wide setting with no C call (by code object:
# the Python-held torch.backends flags, opt_einsum and mha fastpath, named like setters; print options, the default
# device): how to name each, or None.
_SETTERS: dict[Any, str | None] = caches.register({}, "regions.purity torch setters")


def _setter_name(fn: Any) -> str | None:
    module, name = getattr(fn, "__module__", None), getattr(fn, "__name__", "")
    if not isinstance(module, str):
        module = getattr(getattr(fn, "__self__", None), "__name__", "")
    return f"{module}.{name} (a process-wide torch setting)" if global_setter(module, name) else None


def python_setter(code: types.CodeType) -> str | None:
    """How to name torch Python code about to run that sets a process-wide setting (see above), or None."""
    what = _SETTERS.get(code, False)
    if what is False:
        what = _SETTERS[code] = _python_setter_name(code)
    return what


@functools.cache
def _named_python_setters() -> tuple[str, dict[types.CodeType, str]]:
    import torch

    return os.path.dirname(torch.backends.__file__) + os.sep, {
        torch.set_printoptions.__code__: "torch.set_printoptions",
        torch.set_default_device.__code__: "torch.set_default_device"}


caches.register(_named_python_setters, "regions.purity torch's Python setters")


def _python_setter_name(code: types.CodeType) -> str | None:
    backends, named = _named_python_setters()
    what = named.get(code)
    if what is None and code.co_filename.startswith(backends) and _SETTER.match(code.co_name):
        what = f"torch.backends' {code.co_name} (a process-wide torch setting)"
    return what


def torch_state_call(fn: Any, frame: types.FrameType | None = None) -> str | None:
    """How to name a C call torch's own Python makes for the user that a trace cannot keep, or None. `frame`
    makes the call (`saved_tensors_hooks.__enter__` of checkpointing: its hooks keep values, see
    trace/op_facts.py)."""
    if type(getattr(fn, "__self__", None)) is _torch_generator:
        return "a torch.Generator method (torch.manual_seed?)"
    try:
        what = _TORCH_STATE.get(fn)
        if what is None:
            what = _SETTERS.get(fn, False)
            if what is False:
                what = _SETTERS[fn] = _setter_name(fn)
    except TypeError:  # (unhashable)
        return None
    if what is not None and fn is push_saved_tensors_default_hooks and frame is not None:
        hooks = frame.f_locals.get("self")
        if saved_hooks_keep_values(getattr(hooks, "pack_hook", None)):
            return None
    return what


_STDLIB = tuple(dict.fromkeys(os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib"))
                | dict.fromkeys(sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib")))
# Standard-library code whose C calls are its own business: output (logging's timestamps), imports, source
# lines for messages, waiting with timeouts, a callable's signature (`inspect.unwrap` keys its cycle check by
# `id()`: the addresses stay inside the call).
_QUIET_STDLIB = ("logging" + os.sep, "importlib" + os.sep, "warnings.py", "linecache.py", "tokenize.py",
                 "traceback.py", "threading.py", "inspect.py")
_QUIET_FROZEN = ("importlib", "_frozen_importlib", "zipimport", "runpy", "site", "codecs", "encodings", "io>")
_WATCHED: dict[str, bool] = caches.register({}, "regions.purity watched files")


def watched_file(filename: str) -> bool:
    """Whether C calls made by code of this file are checked: user code, and the standard library's Python
    (less the modules in _QUIET_STDLIB). Torch's and stampout's are not."""
    watched = _WATCHED.get(filename)
    if watched is None:
        if is_user_file(filename):
            watched = True
        elif filename.startswith("<frozen "):  # (3.11 freezes os, posixpath, genericpath: `os.path.exists` stats
            watched = not filename[8:].startswith(_QUIET_FROZEN)  # the disk from "<frozen genericpath>")
        else:
            inner = next((filename[len(d):] for d in _STDLIB if filename.startswith(d)), None)
            watched = inner is not None and not inner.startswith(_QUIET_STDLIB) and "-packages" not in inner
        _WATCHED[filename] = watched
    return watched


def user_caller(frame: types.FrameType, quiet_too: bool = False) -> types.FrameType | None:
    """The user frame that called the standard library's code running in `frame` (None: torch or stampout
    called it, as when FX names a temporary file). `quiet_too`: through the quiet standard library as well."""
    f: types.FrameType | None = frame
    while f is not None and not is_user_file(f.f_code.co_filename):
        if not watched_file(f.f_code.co_filename) and not (quiet_too and _in_stdlib(f.f_code.co_filename)):
            return None
        f = f.f_back
    return f


def _in_stdlib(filename: str) -> bool:
    return any(filename.startswith(d) for d in _STDLIB) and "-packages" not in filename


def location(frame: types.FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


