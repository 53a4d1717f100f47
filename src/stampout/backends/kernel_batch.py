"""One C++ library per compile: the CPU kernels of Inductor's Python wrapper built together.

Inductor's Python wrapper loads each CPU kernel with `async_compile.cpp_pybinding(argtypes, source)`: one C++
file and one compiler run per kernel, each parsing the kernel header cpp_prefix.h (ATen's vectorized headers:
about 1.6 s CPU of the 1.9 s a file of 6 small kernels takes at -O3; with the header precompiled 0.8 s per kernel,
after 4.5 s to precompile it). A training region's forward and backward load 5-15 kernels each, so the compiler
time of a compile was mostly that header.

Inside `pipeline.overlapped()` (this thread, with a compile pool), `Collector.add` takes each `cpp_pybinding`
call into the open *batch* and returns a future. A generated module's final `async_compile.wait(globals())`
closes the batch once it holds `CLOSE_AT` kernels; a smaller batch stays open for the next module's kernels (the
backward's, the next region's), and the end of `overlapped()` closes it. Closing hands ONE library build to
Inductor's compile pool: the kernels' sources one after another, each in a namespace of its own with its entry
point renamed `kernel_<i>` (a macro, so the body is untouched) and torch's own Python-binding code for it, and one
`PyInit_kernel` that gathers the entry points. A future resolved before its batch closed closes it; a kernel that
arrives after that starts a new batch. The library goes through `CppPythonBindingsCodeCache.load_async` as one
kernel would: the same compiler command and flags, cached by its source (a restart on the same cache directory,
which loads the same modules in the same order, builds nothing), loaded as one module.

What is batched is decided from the source alone and fails closed: a kernel whose preprocessor lines are not
leading `#include`s and `#pragma`s, or a call with arguments beyond (argtypes, source), goes Inductor's own way;
a batch of one kernel is Inductor's own build; a batch whose source, build or load fails is built again kernel by
kernel the way Inductor builds them, each handed to the compile pool as a batch of one is (a warning says so). The generated Python code and each kernel's code are
unchanged (no cache key changes); only how many compiler runs build them.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("stampout.backends")

_NAMESPACE = "stampout_batch_{}"
_ENTRY = "kernel_{}"
_DIRECTIVE = re.compile(r"^\s*#\s*(\w+)")
# A batch closes at the end of a module once it has this many kernels; a smaller one takes the next module's kernels
# too (the forward's and the backward's, several regions'), until the compile ends: each more library costs a parse
# of cpp_prefix.h (about 1.6 s CPU), about what 16 kernels' own code costs the compiler.
CLOSE_AT = 16
# This process: kernels built in batches, batches built, kernels left to Inductor (not batchable, or alone),
# batches whose build failed and were built kernel by kernel.
STATS = {"kernels_batched": 0, "batches": 0, "kernels_alone": 0, "batches_failed": 0}


def supported(cls: Any) -> bool:
    """Whether `cls` (CppPythonBindingsCodeCache) writes its bindings as torch 2.13 does."""
    return all(isinstance(getattr(cls, name, None), str)
               for name in ("suffix_template", "call_entry_function", "extra_parse_arg", "entry_function")) \
        and cls.entry_function == "kernel" and callable(getattr(cls, "load_async", None))


def _split(source: str) -> tuple[list[str], str] | None:
    """(the leading `#include` lines, the rest) of a kernel's source, or None when it has another preprocessor
    directive than `#pragma` after them (a `#define` would reach the next kernel's code)."""
    lines = source.splitlines()
    i = 0
    while i < len(lines) and (not lines[i].strip() or _directive(lines[i]) == "include"):
        i += 1
    if any(_directive(line) not in (None, "pragma") for line in lines[i:]):
        return None
    return [line.strip() for line in lines[:i] if line.strip()], "\n".join(lines[i:])


def _directive(line: str) -> str | None:
    match = _DIRECTIVE.match(line)
    return match.group(1) if match else None


def _binding(cls: Any, argtypes: list[str], entry: str) -> tuple[list[str], str]:
    """torch's Python-binding code for one kernel entry point `entry` (CppPythonBindingsCodeCache's
    `load_pybinding_async`, as it writes it), split into its preprocessor lines and the rest."""
    parseargs = ", ".join(f"parse_arg<{argtype.replace('const ', '')}>(args, {n})"
                          for n, argtype in enumerate(argtypes))
    suffix = cls.suffix_template.format(arg_len=len(argtypes), call_entry_func=cls.call_entry_function.format(parseargs),
                                        entry_func=entry, extra_parse_arg=cls.extra_parse_arg.format(array_len=-1))
    lines = suffix.splitlines()
    directives = [line.strip() for line in lines if _directive(line) in ("include", "define")]
    return directives, "\n".join(line for line in lines if line.strip() not in directives)


def combined_source(cls: Any, kernels: list[tuple[list[str], list[str], str]]) -> str:
    """One C++ file for `kernels` ((argtypes, includes, body) each): every include once, first, in order (the
    headers are guarded); then each kernel and its binding in a namespace of its own, `kernel` renamed by a macro;
    then `PyInit_kernel`, a module holding every `kernel_<i>`."""
    head: list[str] = []
    parts: list[str] = []
    init: list[str] = []
    for i, (argtypes, includes, body) in enumerate(kernels):
        directives, binding = _binding(cls, argtypes, _ENTRY.format(i))
        head.extend(line for line in (*includes, *directives) if line not in head)
        parts.append(f"namespace {_NAMESPACE.format(i)} {{\n#define kernel {_ENTRY.format(i)}\n{body}\n{binding}\n"
                     f"#undef kernel\n}}  // namespace {_NAMESPACE.format(i)}\n")
        init.append(f"    if (stampout_add(module, {_NAMESPACE.format(i)}::PyInit_{_ENTRY.format(i)}(), "
                    f"\"{_ENTRY.format(i)}\") < 0) {{ Py_DECREF(module); return NULL; }}")
    gather = "\n".join((
        "static int stampout_add(PyObject* module, PyObject* part, const char* name) {",
        "    if (part == NULL) return -1;",
        "    PyObject* fn = PyObject_GetAttrString(part, name);",
        "    Py_DECREF(part);",
        "    if (fn == NULL) return -1;",
        "    if (PyModule_AddObject(module, name, fn) < 0) { Py_DECREF(fn); return -1; }",
        "    return 0;",
        "}",
        "static struct PyModuleDef stampout_batch_module = {PyModuleDef_HEAD_INIT, \"kernel\", NULL, -1, NULL};",
        "PyMODINIT_FUNC PyInit_kernel(void) {",
        "    PyObject* module = PyModule_Create(&stampout_batch_module);",
        "    if (module == NULL) return NULL;",
        *init,
        "    return module;",
        "}",
    ))
    return "\n".join((*head, *parts, gather)) + "\n"


class Batch:
    """Kernels of one or more generated modules, built as one library once closed."""

    def __init__(self, cls: Any, submit: Callable[..., Any]) -> None:
        self.cls, self.submit = cls, submit
        self.kernels: list[tuple[list[str], list[str], str]] = []
        self.sources: list[tuple[list[str], str]] = []  # (argtypes, source) as Inductor got them
        self._lock = threading.Lock()
        self._load: Callable[[], Any] | None = None
        self._entries: list[Callable[[], Any]] | None = None

    def add(self, argtypes: list[str], source: str, includes: list[str], body: str) -> int:
        with self._lock:
            assert self._load is None and self._entries is None, "a closed batch takes no kernels"
            self.kernels.append((list(argtypes), includes, body))
            self.sources.append((list(argtypes), source))
            return len(self.kernels) - 1

    def close(self) -> None:
        """Hand the build to the compile pool (once)."""
        with self._lock:
            if self._load is not None or self._entries is not None:
                return
            if len(self.kernels) == 1:  # Inductor's own build
                STATS["kernels_alone"] += 1
                self._entries = [self.cls.load_pybinding_async(*self.sources[0], submit_fn=self.submit)]
                return
            try:
                self._load = self.cls.load_async(combined_source(self.cls, self.kernels), "cpu", submit_fn=self.submit)
            except Exception as error:  # noqa: BLE001 - see _one_by_one
                self._one_by_one(error)
                return
            STATS["batches"] += 1
            STATS["kernels_batched"] += len(self.kernels)

    def entry(self, index: int) -> Callable[..., Any]:
        """Kernel `index`'s Python entry point (closes the batch; waits for its build)."""
        self.close()
        with self._lock:
            if self._entries is None:
                try:
                    module = self._load()
                    self._entries = [(lambda fn=getattr(module, _ENTRY.format(i)): fn) for i in range(len(self.kernels))]
                except Exception as error:  # noqa: BLE001 - see _one_by_one
                    STATS["batches_failed"] += 1
                    self._one_by_one(error)
            return self._entries[index]()

    def _one_by_one(self, error: Exception) -> None:
        """Any failure to write, build or load the combined library: each kernel built as Inductor builds it."""
        log.warning("kernel batch: building %d kernels as one library failed (%s: %s); building them one by one",
                    len(self.kernels), type(error).__name__, (str(error).splitlines() or [""])[0][:200])
        self._entries = [self.cls.load_pybinding_async(*s, submit_fn=self.submit) for s in self.sources]


class Collector:
    """The open batch of one thread's compile: `cpp_pybinding` calls join it until it closes."""

    def __init__(self, cls: Any, submit: Callable[..., Any], future: Callable[[Callable[[], Any]], Any]) -> None:
        self.cls, self.submit, self.future = cls, submit, future
        self.open: Batch | None = None

    def add(self, argtypes: Any, source: Any) -> Any:
        """A future of the kernel's entry point, or None when Inductor should load this kernel itself."""
        split = _split(source) if isinstance(source, str) and isinstance(argtypes, (list, tuple)) else None
        if split is None:
            STATS["kernels_alone"] += 1
            return None
        if self.open is None:
            self.open = Batch(self.cls, self.submit)
        batch = self.open
        index = batch.add(list(argtypes), source, *split)
        return self.future(lambda: self._resolve(batch, index))

    def _resolve(self, batch: Batch, index: int) -> Any:
        if self.open is batch:  # resolved before its module's wait: later kernels start a new batch
            self.open = None
        return batch.entry(index)

    def close(self, at_module_end: bool = False) -> None:
        """Close the open batch: its build goes to the pool. At a module's end, only a batch of `CLOSE_AT`
        kernels or more."""
        if self.open is None or (at_module_end and len(self.open.kernels) < CLOSE_AT):
            return
        batch, self.open = self.open, None
        batch.close()
