"""A restart compiles nothing: a second process on the same TORCHINDUCTOR_CACHE_DIR finds the region's (or the whole
graph's) forward and backward in AOTAutogradCache and the FX graph cache, and Inductor's ISA verdicts in stampout's
store. (Its own file: two cold and two warm Inductor processes, so xdist can run it beside test_backends.py.)"""

from __future__ import annotations

import pytest

_RESTART = """
import json, sys, threading, torch, stampout
from stampout.backends import startup, toolchain
from torch._inductor.codecache import torch_key
from stampout.tools.models import LlamaConfig, LlamaLike
from torch._dynamo.utils import counters
stampout.config.glue = sys.argv[1]
fn = stampout.compile(LlamaLike(LlamaConfig(layers=2), regions=True), backend="inductor")
fn(torch.randint(0, 128, (2, 8))).float().pow(2).mean().backward()
for thread in threading.enumerate():
    if thread.name == "stampout-torch-key":  # (the cold process hashes and stores on it)
        thread.join()
used = torch_key()
torch_key.clear()  # torch's own hash, now: the value the store gave must be it
print(json.dumps({**{k: v for g in ("aot_autograd", "inductor") for k, v in counters[g].items() if "cache" in k},
                  "isa": toolchain.STATS, "restart": startup.STATS, "right_torch_key": used == torch_key()}))
"""


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize("glue", ["auto", "whole"], ids=["regions_apart", "whole_graph"])
def test_a_restart_finds_everything_in_the_caches(tmp_path, glue):
    """A second process on the same TORCHINDUCTOR_CACHE_DIR compiles nothing: the region's (or, whole, the
    graph's with invoke_subgraph and allow_buffer_reuse=False) forward and backward come from AOTAutogradCache
    and the FX graph cache, Inductor's ISA check from stampout's store, torch's source hash (the same value as
    torch's own) from the store, and no C++ header is precompiled for the modules it loads; the first process
    builds its first modules without one (not built yet, none skipped)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _RESTART, glue], env=env, capture_output=True, text=True,
                              check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold.get("autograd_cache_miss") == 1 and cold.get("fxgraph_cache_miss") == 2, cold
    assert not cold.get("autograd_cache_bypass") and not cold.get("fxgraph_cache_bypass"), cold
    assert sum(cold["isa"].values()) >= 1, cold  # Inductor's own instances were checked, not answered by the plan
    assert warm.get("autograd_cache_hit") == 1 and warm.get("fxgraph_cache_hit") == 2, warm
    assert not warm.get("autograd_cache_miss") and not warm.get("fxgraph_cache_miss"), warm
    assert not warm.get("autograd_cache_bypass") and not warm.get("fxgraph_cache_bypass"), warm
    assert warm["isa"]["run"] == 0 and warm["isa"]["waited"] == 0 and warm["isa"]["remembered"] >= 1, warm
    assert cold["restart"]["key_hashed"] == 1 and cold["restart"]["key_remembered"] == 0, cold
    assert cold["restart"]["headers_deferred"] >= 1 and cold["restart"]["headers_skipped"] == 0, cold
    assert warm["restart"]["key_remembered"] == 1 and warm["restart"]["key_hashed"] == 0, warm
    assert warm["restart"]["headers_skipped"] >= 1 and warm["restart"]["headers_precompiled"] == 0, warm
    assert cold["right_torch_key"] and warm["right_torch_key"], (cold, warm)


# ---------------------------------------------------------------------------------------- startup.py, in process


def _tree(root):
    """A stand-in torch directory: a package, a module, an extension, a __pycache__, a header, torch's extra file."""
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "_inductor").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod.py").write_text("A = 1\n")
    (root / "pkg" / "ext.so").write_bytes(b"\x7fELF")
    (root / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"pyc")
    (root / "include" / "x.h").write_text("int x;\n")
    (root / "_inductor" / "script.ld").write_text("ld\n")


def test_the_torch_key_fingerprint_misses_when_a_file_torch_hashes_changes(tmp_path):
    """`torch_key()` is filled from the store only under a fingerprint of torch's files: a module rewritten to the
    same size with its mtime put back, a new module, an extension or torch's extra file changed each give another
    fingerprint; what torch does not hash (bytecode caches, headers) does not."""
    import os
    import time

    from stampout.backends.startup import fingerprint

    _tree(tmp_path)
    root = str(tmp_path)
    first = fingerprint(root, "2.13.0")
    assert fingerprint(root, "2.13.0") == first
    assert fingerprint(root, "2.14.0") != first

    (tmp_path / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"other bytecode")
    (tmp_path / "include" / "x.h").write_text("int y;\n")
    assert fingerprint(root, "2.13.0") == first

    mod = tmp_path / "pkg" / "mod.py"
    before = os.stat(mod)
    time.sleep(0.05)  # (past the file system's timestamp granularity, so the ctime moves)
    mod.write_text("A = 2\n")  # same size
    os.utime(mod, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the same mtime: only the ctime tells
    assert os.stat(mod).st_size == before.st_size and os.stat(mod).st_mtime_ns == before.st_mtime_ns
    changed = fingerprint(root, "2.13.0")
    assert changed != first

    (tmp_path / "pkg" / "new.py").write_text("")
    added = fingerprint(root, "2.13.0")
    assert added != changed
    (tmp_path / "pkg" / "ext.so").write_bytes(b"\x7fELF2")
    extension = fingerprint(root, "2.13.0")
    assert extension != added
    (tmp_path / "_inductor" / "script.ld").write_text("ld 2\n")
    extra = fingerprint(root, "2.13.0")
    assert extra != extension

    outside = tmp_path.parent / f"{tmp_path.name}_linked"  # a package that is a symbolic link (torch follows it)
    outside.mkdir()
    (outside / "__init__.py").write_text("")
    (outside / "loop").symlink_to(outside)  # (a cycle: walked once)
    (tmp_path / "linked").symlink_to(outside)
    linked = fingerprint(root, "2.13.0")
    assert linked != extra
    (outside / "__init__.py").write_text("B = 1\n")
    assert fingerprint(root, "2.13.0") != linked


def test_headers_are_not_precompiled_only_inside_stampouts_compiles(tmp_path, monkeypatch):
    """startup.py's `_precompile_header` answers "no header" only on a thread inside `scope()`, for the module the
    last `main.cpp` write is for: when it is built, and for the first PRECOMPILE_AFTER modules not built that need
    the header; anywhere else (torch.compile, another thread, an AOTInductor build writing other files) and after
    those, it is Inductor's."""
    import threading

    from stampout.backends import startup

    writes, headers = [], []

    def write(content, extension, **kwargs):
        writes.append(extension)
        return "key", str(tmp_path / f"ckey.{extension}")

    def precompile(header, cmd_line, **command):
        headers.append(header)
        return f"{header}.pch"

    monkeypatch.setattr(startup, "_installed", [write, precompile])
    monkeypatch.setattr(startup, "STATS", dict.fromkeys(startup.STATS, 0))
    monkeypatch.setattr(startup, "_uses", {})
    built = tmp_path / "ckey.main.so"

    def load(extension="main.cpp"):  # CppCodeCache.load_async's order: write the source, then the header
        startup._write("int main;", extension)
        return startup._precompile_header("cpp_prefix.h", "g++ ...")

    built.write_bytes(b"")
    assert load() == "cpp_prefix.h.pch"  # outside scope(): as torch.compile's
    with startup.scope():
        assert load() is None  # built: no header
        assert load("cpp") == "cpp_prefix.h.pch"  # another kind of build
        other: list = []
        thread = threading.Thread(target=lambda: other.append(load()))
        thread.start()
        thread.join()
        assert other == ["cpp_prefix.h.pch"]  # another thread
        built.unlink()
        assert [load() for _ in range(startup.PRECOMPILE_AFTER)] == [None] * startup.PRECOMPILE_AFTER  # not built
        assert load() == "cpp_prefix.h.pch"  # and needed once more: precompiled
        assert startup.STATS["headers_deferred"] == startup.PRECOMPILE_AFTER
    assert startup.STATS["headers_skipped"] == 1 and len(headers) == 4


def test_a_header_an_earlier_process_precompiled_is_used_at_once(tmp_path, monkeypatch):
    """A later process does not build its first modules without a precompiled header that an earlier one built
    (the store names its file for the header and command line, and the `.gch` is there): Inductor gets the header
    from the first module on. Once the `.gch` is gone, or for another command line, the first modules are again
    built without it."""
    from stampout import store
    from stampout.backends import startup

    header_file = tmp_path / "headers" / "chash.h"
    header_file.parent.mkdir()
    headers = []

    def precompile(header, cmd_line, **command):  # Inductor's: writes <hash>.h and builds <hash>.h.gch beside it
        headers.append(cmd_line)
        header_file.write_text(f"#include <{header}>\n")
        (tmp_path / "headers" / "chash.h.gch").write_bytes(b"")
        return str(header_file)

    def write(content, extension, **kwargs):
        return "key", str(tmp_path / f"ckey.{extension}")

    monkeypatch.setattr(store, "directory", lambda: str(tmp_path / "store"))
    monkeypatch.setattr(startup, "_installed", [write, precompile])

    def process():  # a fresh process's state
        monkeypatch.setattr(startup, "STATS", dict.fromkeys(startup.STATS, 0))
        monkeypatch.setattr(startup, "_uses", {})

    def load(cmd_line="g++ ..."):  # a module not built yet
        startup._write("int main;", "main.cpp")
        return startup._precompile_header("cpp_prefix.h", cmd_line)

    process()
    with startup.scope():
        assert [load() for _ in range(startup.PRECOMPILE_AFTER)] == [None] * startup.PRECOMPILE_AFTER
        assert load() == str(header_file) and startup.STATS["headers_built"] == 0
    process()
    with startup.scope():
        assert load() == str(header_file) and load() == str(header_file)  # the later process: at once
        assert startup.STATS["headers_built"] == 1 and startup.STATS["headers_deferred"] == 0
        assert load("clang++ ...") is None  # another command line: its header was never precompiled
    process()
    (tmp_path / "headers" / "chash.h.gch").unlink()
    with startup.scope():
        assert load() is None and startup.STATS["headers_deferred"] == 1 and startup.STATS["headers_built"] == 0
    assert headers == ["g++ ..."] * 3
