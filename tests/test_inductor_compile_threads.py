"""One Inductor compile thread does not hang stampout's overlapped C++ compile (backends/pipeline.py).

With `compile_threads` 1 Inductor has no pool and builds synchronously, inside the file lock the build takes again:
handing that build to `AsyncCompile.submit` deadlocked until the lock timed out. Each case is a fresh process (the
setting is read once per process, and a hang must not take the test run with it) with its own Inductor cache, so
the C++ wrapper is really built; the child counts the builds and dumps its stacks if it stalls.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_CHILD = """
import faulthandler, sys
faulthandler.dump_traceback_later(float(sys.argv[2]), exit=True)  # a hang shows its stacks, then fails
import torch, stampout
from stampout.torch_internals import CppWrapperCodeCache, get_compile_threads
if sys.argv[1] == "config":
    torch._inductor.config.compile_threads = 1
builds = []
load_pybinding_async = CppWrapperCodeCache.load_pybinding_async.__func__
def counted(cls, *args, **kwargs):
    builds.append(kwargs.get("submit_fn") is not None)
    return load_pybinding_async(cls, *args, **kwargs)
CppWrapperCodeCache.load_pybinding_async = classmethod(counted)
model = torch.nn.Linear(4, 4)
fn = stampout.compile(model, backend="inductor")
x = torch.randn(2, 4)
with torch.no_grad():
    torch.testing.assert_close(fn(x), model(x))
print(get_compile_threads(), len(builds), sum(builds))
"""


@pytest.mark.inductor
@pytest.mark.parametrize("how", ["env", "config"])
def test_one_compile_thread_builds_the_cpp_wrapper_without_hanging(tmp_path, how):
    """`TORCHINDUCTOR_COMPILE_THREADS=1` or `torch._inductor.config.compile_threads = 1`: the C++-wrapper graph is
    built once, synchronously (not handed to a pool that does not exist), and gives the eager values."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PYTHONPATH": os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    if how == "env":
        env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-c", _CHILD, how, "240"], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    threads, builds, submitted = map(int, proc.stdout.split()[-3:])
    assert threads == 1
    assert builds == 1 and submitted == 0  # the C++ wrapper was built, by Inductor's own synchronous path
