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
    builds its first modules without one or precompiles it in the background (none built before, none skipped)."""
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
    assert cold["restart"]["headers_skipped"] == 0 and cold["restart"]["headers_built"] == 0, cold
    assert cold["restart"]["headers_deferred"] + cold["restart"]["headers_background"] >= 1, cold
    assert warm["restart"]["key_remembered"] == 1 and warm["restart"]["key_hashed"] == 0, warm
    assert warm["restart"]["headers_skipped"] >= 1 and warm["restart"]["headers_precompiled"] == 0, warm
    assert warm["restart"]["headers_background"] == 0, warm
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


def _wrapper(kernels):
    """A Python wrapper's source that loads `kernels` C++ kernels, as Inductor generates it."""
    return "".join(f"cpp_fused_{i} = async_compile.cpp_pybinding(['float*'], r'''...''')\n" for i in range(kernels))


@pytest.fixture
def fresh_startup(monkeypatch, tmp_path):
    """startup.py as in a fresh process, its store in tmp_path; Inductor's functions replaced by the test's
    (`fresh_startup(write, precompile, build)`)."""
    from stampout.backends import startup, store

    monkeypatch.setattr(store, "directory", lambda: str(tmp_path / "store"))

    def install(write, precompile, build=None):
        monkeypatch.setattr(startup, "_installed", [write, precompile, build])
        monkeypatch.setattr(startup, "STATS", dict.fromkeys(startup.STATS, 0))
        monkeypatch.setattr(startup, "_chosen", set())
        monkeypatch.setattr(startup, "_pending", {})
        return startup

    return install


def test_headers_are_not_precompiled_only_inside_stampouts_compiles(tmp_path, fresh_startup):
    """startup.py's `_precompile_header` answers "no header" only on a thread inside `scope()`, for the module the
    last `main.cpp` write is for: when it is built, and while too few modules remain for the header to pay (the
    kernels of the Python wrapper being loaded, twice as many when a training forward's backward follows, one per
    graph still to compile); anywhere else (torch.compile, another thread, an AOTInductor build writing other
    files) and once chosen, it is Inductor's."""
    import threading

    from stampout.backends import progress

    headers = []

    def write(content, extension, **kwargs):
        return "key", str(tmp_path / f"ckey.{extension}")

    def precompile(header, cmd_line, **command):
        headers.append(header)
        return f"{header}.pch"

    startup = fresh_startup(write, precompile)
    header = "torch/csrc/inductor/cpp_prefix.h"
    built = tmp_path / "ckey.main.so"

    def load(extension="main.cpp"):  # CppCodeCache.load_async's order: write the source, then the header
        startup._write("int main;", extension)
        return startup._precompile_header(header, "g++ ...")

    built.write_bytes(b"")
    assert load() == f"{header}.pch"  # outside scope(): as torch.compile's
    with startup.scope():
        assert load() is None  # built: no header
        assert load("cpp") == f"{header}.pch"  # another kind of build
        other: list = []
        thread = threading.Thread(target=lambda: other.append(load()))
        thread.start()
        thread.join()
        assert other == [f"{header}.pch"]  # another thread
        built.unlink()
        assert load() is None  # one module (a C++ wrapper's): does not pay
        startup._write(_wrapper(4), "py")  # a Python wrapper loading 4 kernels: does not pay either
        assert [load() for _ in range(4)] == [None] * 4
        with startup.scope(backward_follows=True):  # 4 kernels and a backward to follow: it pays
            startup._write(_wrapper(4), "py")
            assert load() == f"{header}.pch" and startup.STATS["headers_background"] == 1
        assert startup.STATS["headers_deferred"] == 5
        assert load() == f"{header}.pch"  # chosen once: every later module of this process gets it
    with progress.compiling("a model"), startup.scope():
        startup._chosen.clear()
        progress.expect(4)  # this graph and 3 more to compile: 4 modules of one C++ wrapper each
        assert load() is None and startup.modules_ahead() == 4
        progress.expect(1)
        assert startup.modules_ahead() == 5 and load() == f"{header}.pch"
    assert startup.STATS["headers_skipped"] == 1 and len(headers) == 6


def test_modules_ahead_counts_the_kernels_a_wrapper_still_loads(fresh_startup, tmp_path):
    """The estimate that decides: a Python wrapper's kernels not loaded yet, this one included."""
    startup = fresh_startup(lambda content, extension, **kw: ("key", str(tmp_path / f"k.{extension}")), None)
    with startup.scope():
        startup._write(_wrapper(6), "py")
        seen = []
        for _ in range(6):
            startup._write("int main;", "main.cpp")
            seen.append(startup.modules_ahead())
        assert seen == [6, 5, 4, 3, 2, 1]
        startup._write("graph", "py")  # a C++ wrapper's Python module: its one module
        startup._write("int main;", "main.cpp")
        assert startup.modules_ahead() == 1
    kernels, others = startup.KERNEL_HEADER, "torch/csrc/inductor/cpp_wrapper/cpu.h"
    assert not startup.pays(kernels, startup.PAYS_FROM_KERNELS - 1) and startup.pays(kernels, startup.PAYS_FROM_KERNELS)
    assert not startup.pays(others, startup.PAYS_FROM_OTHERS - 1) and startup.pays(others, startup.PAYS_FROM_OTHERS)


class _Builder:
    """What `_worker_compile_cpp` reads of Inductor's CppBuilder."""

    def __init__(self, target, precompiling=False, header=None):
        self._precompiling = precompiling
        self._build_option = type("Options", (), {"precompiled_header": header})()
        self.target = target

    def get_target_file_path(self):
        return str(self.target)


def test_a_header_that_pays_is_precompiled_in_the_background_and_builds_using_it_wait(tmp_path, fresh_startup):
    """Where the header pays, Inductor's `_precompile_header` gets its path at once (the loading thread goes on)
    while its precompiled form builds on a background thread; a module's build whose command includes the header
    waits for it (and then finds the `.gch`), a build without it does not; once built, the store remembers it (a
    later process uses it from its first module). A failed precompile leaves the waiting builds to compile with
    the header's text."""
    import threading

    header = tmp_path / "headers" / "chash.h"
    header.parent.mkdir()
    release, order = threading.Event(), []

    def build(lock_path, builders):  # Inductor's _worker_compile_cpp
        for b in builders:
            if b._precompiling:
                release.wait()
                b.target.write_bytes(b"gch")
                order.append("header")
            else:
                gch = (tmp_path / "headers" / "chash.h.gch").exists()
                order.append(("kernel", b._build_option.precompiled_header, gch))

    def precompile(name, cmd_line, **command):  # Inductor's: preprocess, write <hash>.h, build its .gch
        header.write_text(f"#include <{name}>\n")
        startup._worker_compile_cpp("header.lock", (_Builder(header.with_name("chash.h.gch"), precompiling=True),))
        return str(header)

    startup = fresh_startup(lambda content, extension, **kw: ("key", str(tmp_path / f"k.{extension}")), precompile,
                            build)
    with startup.scope():
        startup._write(_wrapper(8), "py")
        startup._write("int main;", "main.cpp")
        assert startup._precompile_header("cpp_prefix.h", "g++ ...") == str(header)  # (the build is blocked)
    assert startup.STATS["headers_background"] == 1 and list(startup._pending) == [str(header)]
    startup._worker_compile_cpp("other.lock", (_Builder(tmp_path / "other.so"),))  # no header: at once
    kernel = threading.Thread(target=startup._worker_compile_cpp,
                              args=("k.lock", (_Builder(tmp_path / "k.so", header=str(header)),)))
    kernel.start()
    kernel.join(0.2)  # (had it not waited, it would have built by now)
    assert order == [("kernel", None, False)]
    release.set()
    kernel.join()
    [builder] = [t for t in threading.enumerate() if t.name == "stampout-header"] or [None]
    if builder is not None:
        builder.join()
    assert order == [("kernel", None, False), "header", ("kernel", str(header), True)]
    assert startup._precompiled_before("cpp_prefix.h", "g++ ...") and not startup._pending

    def failing(lock_path, builders):
        if builders[0]._precompiling:
            raise RuntimeError("g++: internal compiler error")
        order.append("compiled without")

    (tmp_path / "headers" / "chash.h.gch").unlink()
    startup = fresh_startup(lambda content, extension, **kw: ("key", str(tmp_path / f"k.{extension}")), precompile,
                            failing)
    with startup.scope(backward_follows=True):
        startup._write(_wrapper(4), "py")
        startup._write("int main;", "main.cpp")
        assert startup._precompile_header("cpp_prefix.h", "clang++ ...") == str(header)
    startup._worker_compile_cpp("k.lock", (_Builder(tmp_path / "k.so", header=str(header)),))
    assert order[-1] == "compiled without" and not startup._pending
    assert not startup._precompiled_before("cpp_prefix.h", "clang++ ...")


def test_a_header_an_earlier_process_precompiled_is_used_at_once(tmp_path, fresh_startup):
    """A later process does not build its first modules without a precompiled header that an earlier one built
    (the store names its file for the header and command line, and the `.gch` is there): Inductor gets the header
    from the first module on, however few. Once the `.gch` is gone, or for another command line, modules are
    again built without it until it pays."""
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

    def load(cmd_line="g++ ..."):  # a module not built yet
        startup._write("int main;", "main.cpp")
        return startup._precompile_header("cpp_prefix.h", cmd_line)

    startup = fresh_startup(write, precompile)
    with startup.scope():
        assert load() is None
        startup._write(_wrapper(startup.PAYS_FROM_OTHERS), "py")
        assert load() == str(header_file) and startup.STATS["headers_built"] == 0
    startup = fresh_startup(write, precompile)  # a later process
    with startup.scope():
        assert load() == str(header_file) and load() == str(header_file)  # the later process: at once
        assert startup.STATS["headers_built"] == 1 and startup.STATS["headers_deferred"] == 0
        assert load("clang++ ...") is None  # another command line: its header was never precompiled
    startup = fresh_startup(write, precompile)
    (tmp_path / "headers" / "chash.h.gch").unlink()
    with startup.scope():
        assert load() is None and startup.STATS["headers_deferred"] == 1 and startup.STATS["headers_built"] == 0
    assert headers == ["g++ ..."] * 3
