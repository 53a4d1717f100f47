"""What an Inductor process pays before it compiles anything: torch's source hash and C++ header precompiles.

On 2 cores, a restart on a warm `TORCHINDUCTOR_CACHE_DIR`, which finds every compiled graph in the caches, still
spent about 1.5 s on two things whose results it had; a cold process compiling one C++-wrapper module spent twice
the compiler time it needed:

- `torch_key()`, the hash of every module file of the torch install (read in full) that keys the FX graph and
  AOTAutograd caches: about 0.8 s. stampout fills it from its store, keyed by a fingerprint of the same files
  (path, size, mtime, ctime and inode of each importable file under torch's directory, torch's version, and the
  two extra files torch hashes), which one `stat` per file gives in about 50 ms. A file torch would read
  differently has another size, mtime, ctime or inode (ctime cannot be set back, a reinstall replaces files):
  the fingerprint misses, torch hashes (on a background thread) and the store gains the new key.
- `_precompile_header`, which Inductor calls for each C++ module it loads, before it looks whether the module
  is built: it preprocesses the header (about 0.3 s) to name the precompiled header and, the first time, builds
  it, blocking the thread that loads the module (the Python wrapper's kernel header cpp_prefix.h: about 4.5 s,
  after which a kernel compiles in 0.8 s instead of 2.5 s; the C++ wrapper's header: 15 s, saving about 4 s per
  module). Inside stampout's compiles (`scope()`, this thread only) the builder gets no precompiled header when
  the module is already built (nothing is compiled), nor when too few modules remain for it to pay: `pays()`
  compares `modules_ahead()` — the kernels of the Python wrapper being loaded still to load (the C++ wrapper is
  one module), as many again when a training forward's backward follows, one per graph still to compile — with
  PAYS_FROM_KERNELS / PAYS_FROM_OTHERS (the build time over the time it saves per module, times the two cores)
  unless an earlier process built that header's precompiled form (`headers` in the store names the file for each
  header and command line; the `.gch` beside it must still be there, and Inductor's own check of the
  preprocessed header decides whether it is used). Where it pays, the precompiled form is built on a background
  thread (`stampout-header`): the loading thread goes on lowering the next graph, and each build whose command
  includes that header waits for it (`_worker_compile_cpp`, whoever's build it is). A module built without the
  precompiled header is the same code (the generated source includes the header itself;
  TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=0 compiles so).

torch.compile would gain from both as much (its kernels compile with headers precompiled, as by default; with
TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=0 it compiles without); they act only where stampout compiles (the
source hash is per process: once stampout has filled it, a torch.compile in the same process reads the same,
correct value).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

from ..torch_internals import patch_permanently
from . import pipeline, progress, store

log = logging.getLogger("stampout.backends")

_NAMESPACE = "torch_key"
_HEADERS = "headers"  # store: digest of (header, command line) -> the header file Inductor precompiled for them
_EXTRA_FILES = ("_inductor/codegen/aoti_runtime/interface.cpp", "_inductor/script.ld")  # torch_key's extra files
_SUFFIXES = tuple(importlib.machinery.all_suffixes())
_lock = threading.Lock()
_state = threading.local()  # .depth: inside scope(); .binary: the .so the last `main.cpp` write is for
_installed: list[Any] = []  # the originals of codecache.write and codecache._precompile_header, once installed
_chosen: set[tuple[str, str]] = set()  # (header, command line) precompiled for this process's modules
_pending: dict[str, list[Any]] = {}  # header path -> [Event set once built, (header, command line) to store]
# Modules that must remain for a header's precompiled form to pay (see the module docstring): the Python wrapper's
# kernel header, and the others (the C++ wrapper's).
KERNEL_HEADER = "torch/csrc/inductor/cpp_prefix.h"
PAYS_FROM_KERNELS = 5
PAYS_FROM_OTHERS = 8
# This process: torch_key filled from the store / hashed and stored; headers not precompiled for a module that is
# built / for one built without; headers handed to Inductor outside the rules (outside scope(), or once chosen).
# headers_built: precompiled forms an earlier process left, so not deferred; headers_background: precompiles
# started on a background thread because they pay.
STATS = {"key_remembered": 0, "key_hashed": 0, "headers_skipped": 0, "headers_deferred": 0, "headers_precompiled": 0,
         "headers_built": 0, "headers_background": 0}


def fingerprint(root: str, version: str) -> str:
    """A digest of what `torch_key()` reads under `root` (torch's directory), from `stat` alone: every file with
    an importable suffix outside `__pycache__`, and torch's extra files, by path, size, mtime, ctime and inode (of
    the file a link points to)."""
    digest = hashlib.sha256(f"{version}\0{root}\n".encode())

    def add(path: str, st: os.stat_result) -> None:
        digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}\n".encode())

    seen: set[tuple[int, int]] = set()

    def walk(folder: str) -> None:  # (symbolic links followed, as torch's hash follows them; each folder once)
        st = os.stat(folder)
        if (st.st_dev, st.st_ino) in seen:
            return
        seen.add((st.st_dev, st.st_ino))
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            if entry.is_dir():
                if entry.name != "__pycache__":
                    walk(entry.path)
            elif entry.name.endswith(_SUFFIXES):
                add(entry.path, entry.stat())

    walk(root)
    for extra in _EXTRA_FILES:
        path = os.path.join(root, extra)
        if os.path.exists(path):
            add(path, os.stat(path))
    return digest.hexdigest()


def _torch_fingerprint() -> str:
    import torch

    return fingerprint(os.path.dirname(os.path.abspath(torch.__file__)), torch.__version__)


@functools.cache
def fill_torch_key() -> None:
    """Give this process's `torch_key()` its value from the store when torch's files are as when it was stored;
    otherwise hash on a background thread and store the result (once per process)."""
    from ..torch_internals import functorch_config, inductor_config, torch_key

    if not hasattr(torch_key, "set") or not (inductor_config.fx_graph_cache or functorch_config.enable_autograd_cache):
        return  # (not torch 2.13's prefetchable cache, or no cache to key: leave it alone)
    key = _torch_fingerprint()
    stored = store.load(_NAMESPACE).get(key)
    if isinstance(stored, str):
        try:
            torch_key.set(bytes.fromhex(stored))
        except RuntimeError:  # already computed in this process (a torch.compile ran first)
            return
        STATS["key_remembered"] += 1
        return

    def hash_and_store() -> None:
        value = torch_key()
        STATS["key_hashed"] += 1
        store.update(_NAMESPACE, {key: value.hex()})

    # (not a daemon: the process waits for the store to be written, or a restart would hash again)
    threading.Thread(target=hash_and_store, name="stampout-torch-key").start()


@contextlib.contextmanager
def scope(backward_follows: bool = False) -> Iterator[None]:
    """Inductor's module loads on this thread precompile headers only where it pays (see above).
    `backward_follows`: the graph compiled inside is a training forward, whose backward is compiled next."""
    _install()
    outer = getattr(_state, "backward_follows", False)
    _state.depth = getattr(_state, "depth", 0) + 1
    _state.backward_follows = backward_follows or outer
    try:
        yield
    finally:
        _state.depth -= 1
        _state.backward_follows = outer
        if not _state.depth:
            _state.binary, _state.kernels = None, 0


def _install() -> None:
    from ..torch_internals import codecache

    with _lock:
        if _installed or not sys.platform.startswith("linux"):
            return
        if not all(callable(getattr(codecache, name, None))
                   for name in ("_precompile_header", "write", "_worker_compile_cpp")):
            _installed.append(None)
            return
        write = patch_permanently(codecache, "write", _write, "torch._inductor.codecache.write",
                                  "inside stampout's compiles, notes which module a C++ build is for")
        precompile = patch_permanently(codecache, "_precompile_header", _precompile_header,
                                       "torch._inductor.codecache._precompile_header",
                                       "inside stampout's compiles, a header is precompiled only where it pays, "
                                       "on a background thread")
        worker = patch_permanently(codecache, "_worker_compile_cpp", _worker_compile_cpp,
                                   "torch._inductor.codecache._worker_compile_cpp",
                                   "a build that uses a header precompiling in the background waits for it")
        _installed.extend((write, precompile, worker))


_KERNEL_LOAD = "= async_compile.cpp_pybinding("  # how a Python-wrapper module loads each of its C++ kernels


def _write(content: Any, extension: str, *args: Any, **kwargs: Any) -> Any:
    result = _installed[0](content, extension, *args, **kwargs)
    if getattr(_state, "depth", 0):
        # CppCodeCache.load_async writes `<key>.main.cpp` (then, maybe, `optimized.cpp`) before it precompiles
        # headers; the module it links is `<key>.main.so` beside it. Any other write ends that association. A
        # Python wrapper (`.py`) is written before it is loaded, and loads its kernels one after another.
        if extension == "main.cpp":
            _state.binary = os.path.splitext(result[1])[0] + ".so"
            _state.loaded = getattr(_state, "loaded", 0) + 1
        elif extension != "optimized.cpp":
            _state.binary = None
            if extension == "py" and isinstance(content, str):
                kernels = content.count(_KERNEL_LOAD)  # (built as one library when batched: pipeline.py)
                _state.kernels, _state.loaded = min(kernels, 1) if pipeline.batches_kernels() else kernels, 0
    return result


def modules_ahead() -> int:
    """How many modules needing a header this thread's compile will still build, this one included (an estimate,
    from what is known when the first of them asks): the kernels of the Python wrapper being loaded not loaded
    yet (or the one module a C++ wrapper is), as many again when a training forward's backward follows, and one
    for each graph still to compile after this one."""
    kernels = getattr(_state, "kernels", 0)
    here = max(kernels - getattr(_state, "loaded", 1) + 1, 1)
    following = kernels if getattr(_state, "backward_follows", False) else 0
    compile_ = progress.current()
    graphs_after = max(compile_.expected - compile_.done - 1, 0) if compile_ is not None else 0
    return here + following + graphs_after


def pays(header: str, modules: int) -> bool:
    """Whether precompiling `header` pays for `modules` builds that use it."""
    return modules >= (PAYS_FROM_KERNELS if header == KERNEL_HEADER else PAYS_FROM_OTHERS)


def _header_key(header: str, hashable_cmd_line: str) -> str:
    return hashlib.sha256(f"{header}\0{hashable_cmd_line}".encode()).hexdigest()


def _precompiled_before(header: str, hashable_cmd_line: str) -> bool:
    """Whether a process built the precompiled form of `header` for this command line and it is still there."""
    path = store.load(_HEADERS).get(_header_key(header, hashable_cmd_line))
    return isinstance(path, str) and os.path.isfile(path + ".gch")


def _precompile_header(header: str, hashable_cmd_line: str, **compile_command: Any) -> str | None:
    binary = getattr(_state, "binary", None) if getattr(_state, "depth", 0) else None
    if binary is not None:  # inside scope(), a module's build
        if os.path.isfile(binary):
            STATS["headers_skipped"] += 1
            log.debug("startup: %s is built; header %s not precompiled", binary, header)
            return None
        with _lock:
            chosen = (header, hashable_cmd_line) in _chosen
        if not chosen:
            if _precompiled_before(header, hashable_cmd_line):  # (looked up once per process)
                STATS["headers_built"] += 1
            elif not pays(header, modules_ahead()):
                STATS["headers_deferred"] += 1
                log.debug("startup: %s compiled without a precompiled %s", binary, header)
                return None
            else:
                STATS["headers_background"] += 1
                log.debug("startup: %s precompiled on a background thread (%d modules ahead)", header,
                          modules_ahead())
            with _lock:
                _chosen.add((header, hashable_cmd_line))
        _state.background = True  # (the build of the precompiled form, if any: see _worker_compile_cpp)
        try:
            path = _installed[1](header, hashable_cmd_line, **compile_command)
        finally:
            _state.background = False
        with _lock:
            building = _pending.get(path) if isinstance(path, str) else None
            if building is not None:
                building[1] = (header, hashable_cmd_line)  # (stored when built)
        if building is None:
            _remember_header(header, hashable_cmd_line, path)
        return path
    STATS["headers_precompiled"] += 1
    path = _installed[1](header, hashable_cmd_line, **compile_command)
    _remember_header(header, hashable_cmd_line, path)
    return path


def _remember_header(header: str, hashable_cmd_line: str, path: Any) -> None:
    if isinstance(path, str) and os.path.isfile(path + ".gch"):
        key = _header_key(header, hashable_cmd_line)
        if store.load(_HEADERS).get(key) != path:
            store.update(_HEADERS, {key: path})


def _worker_compile_cpp(lock_path: str, builders: Any, *args: Any, **kwargs: Any) -> Any:
    """Inductor's build step. A header's precompile asked for inside stampout's compiles starts on a background
    thread (Inductor's `_precompile_header` returns the header's path at once; it caches that path, so every later
    build, ours or not, is handed it); a build whose command includes a header still precompiling waits for it."""
    build = _installed[2]
    if getattr(_state, "background", False) and len(builders) == 1 and getattr(builders[0], "_precompiling", False):
        target = builders[0].get_target_file_path()
        header = os.path.splitext(target)[0]
        with _lock:
            if os.path.exists(target) or header in _pending:
                return None
            building = _pending[header] = [threading.Event(), None]

        def run() -> None:
            try:
                build(lock_path, builders, *args, **kwargs)
            except Exception as error:  # noqa: BLE001 - the builds that wait for it compile with the header's text
                log.warning("startup: precompiling %s failed (%s); modules are compiled without it", header,
                            (str(error).splitlines() or [""])[0][:200])
            finally:
                with _lock:
                    del _pending[header]
                building[0].set()
            if building[1] is not None:
                _remember_header(*building[1], header)

        # (not a daemon: a process that exits meanwhile waits, rather than leave half a precompiled header)
        threading.Thread(target=run, name="stampout-header").start()
        return None
    with _lock:
        waits = [_pending[h][0] for h in (getattr(getattr(b, "_build_option", None), "precompiled_header", None)
                                       for b in builders) if h in _pending]
    for done in waits:
        done.wait()
    return build(lock_path, builders, *args, **kwargs)
