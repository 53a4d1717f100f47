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
  is built: it preprocesses the header (about 0.8 s) to name the precompiled header and, the first time, builds
  it (hundreds of MB; 15 s for the C++ wrapper's header here, saving about 4 s on each compile that uses it:
  one compile with it took 21 s, without it 10 s). Inside stampout's compiles (`scope()`, this thread only) the
  builder gets no precompiled header when the module is already built (nothing is compiled), and for the first
  `PRECOMPILE_AFTER` modules that need a header in this process (a stack of blocks compiles one or two distinct
  regions), unless an earlier process built that header's precompiled form (`headers` in the store names the
  file for each header and command line; the `.gch` beside it must still be there, and Inductor's own check of
  the preprocessed header decides whether it is used); after that Inductor precompiles it as it would. A module
  built without the precompiled header is the
  same code (the generated source includes the header itself; TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=0
  compiles so).

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

from .. import store
from ..torch_internals import patch_permanently

log = logging.getLogger("stampout.backends")

_NAMESPACE = "torch_key"
_HEADERS = "headers"  # store: digest of (header, command line) -> the header file Inductor precompiled for them
_EXTRA_FILES = ("_inductor/codegen/aoti_runtime/interface.cpp", "_inductor/script.ld")  # torch_key's extra files
_SUFFIXES = tuple(importlib.machinery.all_suffixes())
_lock = threading.Lock()
_state = threading.local()  # .depth: inside scope(); .binary: the .so the last `main.cpp` write is for
_installed: list[Any] = []  # the originals of codecache.write and codecache._precompile_header, once installed
_uses: dict[tuple[str, str], int] = {}  # (header, command line) -> modules built without its precompiled form
PRECOMPILE_AFTER = 2
# This process: torch_key filled from the store / hashed and stored; headers not precompiled for a module that is
# built / for one built without; headers handed to Inductor.
# headers_built: precompiled forms an earlier process left, so not deferred.
STATS = {"key_remembered": 0, "key_hashed": 0, "headers_skipped": 0, "headers_deferred": 0, "headers_precompiled": 0,
         "headers_built": 0}


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
def scope() -> Iterator[None]:
    """Inductor's module loads on this thread precompile headers only where it pays (see above)."""
    _install()
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
        if not _state.depth:
            _state.binary = None


def _install() -> None:
    from ..torch_internals import codecache

    with _lock:
        if _installed or not sys.platform.startswith("linux"):
            return
        if not callable(getattr(codecache, "_precompile_header", None)) or not callable(codecache.write):
            _installed.append(None)
            return
        write = patch_permanently(codecache, "write", _write, "torch._inductor.codecache.write",
                                  "inside stampout's compiles, notes which module a C++ build is for")
        precompile = patch_permanently(codecache, "_precompile_header", _precompile_header,
                                       "torch._inductor.codecache._precompile_header",
                                       "inside stampout's compiles, none for modules already built or the first few")
        _installed.extend((write, precompile))


def _write(content: Any, extension: str, *args: Any, **kwargs: Any) -> Any:
    result = _installed[0](content, extension, *args, **kwargs)
    if getattr(_state, "depth", 0):
        # CppCodeCache.load_async writes `<key>.main.cpp` (then, maybe, `optimized.cpp`) before it precompiles
        # headers; the module it links is `<key>.main.so` beside it. Any other write ends that association.
        if extension == "main.cpp":
            _state.binary = os.path.splitext(result[1])[0] + ".so"
        elif extension != "optimized.cpp":
            _state.binary = None
    return result


def _header_key(header: str, hashable_cmd_line: str) -> str:
    return hashlib.sha256(f"{header}\0{hashable_cmd_line}".encode()).hexdigest()


def _precompiled_before(header: str, hashable_cmd_line: str) -> bool:
    """Whether a process built the precompiled form of `header` for this command line and it is still there."""
    path = store.load(_HEADERS).get(_header_key(header, hashable_cmd_line))
    return isinstance(path, str) and os.path.isfile(path + ".gch")


def _precompile_header(header: str, hashable_cmd_line: str, **compile_command: Any) -> str | None:
    if getattr(_state, "depth", 0):
        binary = getattr(_state, "binary", None)
        if binary is not None and os.path.isfile(binary):
            STATS["headers_skipped"] += 1
            log.debug("startup: %s is built; header %s not precompiled", binary, header)
            return None
        with _lock:
            uses = _uses.get((header, hashable_cmd_line), 0)
            if binary is not None and uses < PRECOMPILE_AFTER:
                if _precompiled_before(header, hashable_cmd_line):
                    _uses[header, hashable_cmd_line] = PRECOMPILE_AFTER  # (looked up once per process)
                    STATS["headers_built"] += 1
                else:
                    _uses[header, hashable_cmd_line] = uses + 1
                    STATS["headers_deferred"] += 1
                    log.debug("startup: %s compiled without a precompiled %s", binary, header)
                    return None
    STATS["headers_precompiled"] += 1
    path = _installed[1](header, hashable_cmd_line, **compile_command)
    if isinstance(path, str) and os.path.isfile(path + ".gch"):
        key = _header_key(header, hashable_cmd_line)
        if store.load(_HEADERS).get(key) != path:
            store.update(_HEADERS, {key: path})
    return path
