"""The Python wrapper's CPU kernels built as one library per generated module (backends/kernel_batch.py).

The compile case is one fresh process with its own Inductor cache and temporary directory, so the kernels are
really built: a training compile whose forward and backward have several kernels each builds them as one library,
not one per kernel, gives eager's outputs and gradients, and a restart on the same cache builds nothing.
The other cases check what is batched and the fallback without a compiler.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from stampout.backends import kernel_batch
from stampout.torch_internals import CppPythonBindingsCodeCache

_CHILD = """
import json, os, torch, stampout
from stampout.backends import kernel_batch

def block(x, w):  # (the matmuls keep the pointwise parts apart: several kernels per module)
    h = torch.nn.functional.silu(torch.softmax(x * w, -1) @ x.t()) @ x
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)

def model(x, w):
    return stampout.region(block)(x, w).cos()

x = torch.randn(4, 8, requires_grad=True)
w = torch.randn(8, requires_grad=True)
out = stampout.compile(model, backend="inductor")(x, w)
out.sum().backward()
x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
model(x2, w2).sum().backward()
torch.testing.assert_close(out, model(x2, w2))
torch.testing.assert_close((x.grad, w.grad), (x2.grad, w2.grad))
print(json.dumps({**kernel_batch.STATS, "compiler_runs": os.times().children_user > 0}))
"""


def _run(tmp_path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TMPDIR": str(tmp_path / "tmp"),
           "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.inductor
def test_a_compiles_kernels_are_built_as_one_library_and_found_again_on_restart(tmp_path):
    """The forward's and the backward's modules load several kernels each; together fewer than CLOSE_AT, they are
    one compiler-built library (`<key>.main.so`); eager's values; the restart on the same cache builds nothing."""
    cold = _run(tmp_path)
    modules = glob.glob(str(tmp_path / "inductor" / "**" / "*.py"), recursive=True)
    kernels = sum(open(m).read().count("async_compile.cpp_pybinding(") for m in modules)
    libraries = glob.glob(str(tmp_path / "inductor" / "**" / "*.main.so"), recursive=True)
    with_kernels = sum("async_compile.cpp_pybinding(" in open(m).read() for m in modules)
    assert cold["batches"] == 1 and cold["batches_failed"] == 0 and cold["kernels_batched"] == kernels, cold
    assert len(libraries) == 1 and kernels > with_kernels == 2, (len(libraries), with_kernels, kernels)
    warm = _run(tmp_path)
    assert warm["batches"] == cold["batches"] and not warm["compiler_runs"], warm
    assert len(glob.glob(str(tmp_path / "inductor" / "**" / "*.main.so"), recursive=True)) == len(libraries)


_KERNEL = '#include <torch/csrc/inductor/cpp_prefix.h>\nextern "C" void kernel(float* out_ptr0)\n{\n}\n'


def test_only_kernels_whose_preprocessor_lines_are_leading_includes_and_pragmas_are_batched():
    assert kernel_batch._split(_KERNEL) == (["#include <torch/csrc/inductor/cpp_prefix.h>"],
                                            'extern "C" void kernel(float* out_ptr0)\n{\n}')
    assert kernel_batch._split(_KERNEL.replace("{\n}", "{\n    #pragma GCC ivdep\n}")) is not None
    assert kernel_batch._split(_KERNEL.replace("{\n}", "{\n#define N 4\n}")) is None
    assert kernel_batch._split(_KERNEL + "#include <cmath>\n") is None  # (an include after code stays where it is)


def test_the_combined_source_renames_each_entry_point_in_a_namespace_of_its_own():
    split = kernel_batch._split(_KERNEL)
    source = kernel_batch.combined_source(CppPythonBindingsCodeCache, [(["float*"], *split), (["float*"], *split)])
    assert source.count("#include <torch/csrc/inductor/cpp_prefix.h>") == 1
    assert source.index("#define PY_SSIZE_T_CLEAN") < source.index("#include <Python.h>") < source.index("namespace")
    for i in (0, 1):
        assert f"namespace stampout_batch_{i} {{\n#define kernel kernel_{i}\n" in source
        assert f"stampout_batch_{i}::PyInit_kernel_{i}()" in source
    assert source.count("PyMODINIT_FUNC PyInit_kernel(void)") == 1


class _FakeCache:
    """CppPythonBindingsCodeCache's surface, with a combined build that fails."""

    suffix_template = CppPythonBindingsCodeCache.suffix_template
    call_entry_function = CppPythonBindingsCodeCache.call_entry_function
    extra_parse_arg = CppPythonBindingsCodeCache.extra_parse_arg
    built: list = []

    @classmethod
    def load_async(cls, code, device, submit_fn=None):
        def load():
            raise RuntimeError("compile failed")
        return load

    submitted_with: list = []

    @classmethod
    def load_pybinding_async(cls, argtypes, source, submit_fn=None):
        cls.built.append(source)
        cls.submitted_with.append(submit_fn)
        return lambda: (lambda: source)


def test_a_batch_whose_build_fails_is_built_kernel_by_kernel(caplog):
    """... each kernel handed to the compile pool (the collector's submit), as a batch of one is."""
    def submit(task):
        return task

    collector = kernel_batch.Collector(_FakeCache, submit, lambda get: get)
    futures = [collector.add(["float*"], _KERNEL.replace("out_ptr0", f"out_ptr{i}")) for i in range(3)]
    collector.close()
    entries = [f() for f in futures]
    assert [e() for e in entries] == _FakeCache.built and len(_FakeCache.built) == 3
    assert _FakeCache.submitted_with == [submit] * 3
    assert "building 3 kernels as one library failed" in caplog.text


class _RecordingCache(_FakeCache):
    """A combined build that succeeds: the library has `kernel_<i>` for each kernel of the batch."""

    libraries: list = []

    @classmethod
    def load_async(cls, code, device, submit_fn=None):
        count = code.count("PyInit_kernel_") // 2  # (each kernel's own PyInit, and its call in PyInit_kernel)
        cls.libraries.append(count)
        module = type("Library", (), {f"kernel_{i}": (lambda i=i: i) for i in range(count)})
        return lambda: module


def test_a_small_batch_spans_modules_and_a_kernel_resolved_early_closes_it(monkeypatch):
    """Below CLOSE_AT, a module's end leaves the batch open for the next module's kernels; a future resolved
    before the batch closed closes it, and the next kernel starts a new batch."""
    monkeypatch.setattr(kernel_batch, "CLOSE_AT", 3)
    collector = kernel_batch.Collector(_RecordingCache, None, lambda get: get)
    def kernel(i: int) -> str:
        return _KERNEL.replace("out_ptr0", f"out_ptr{i}")

    first = [collector.add(["float*"], kernel(i)) for i in range(2)]
    collector.close(at_module_end=True)  # 2 < CLOSE_AT: still open
    first.append(collector.add(["float*"], kernel(2)))
    collector.close(at_module_end=True)  # 3: closed, built as one library
    assert _RecordingCache.libraries == [3] and [f()() for f in first] == [0, 1, 2]
    early = [collector.add(["float*"], kernel(i)) for i in range(3, 5)]
    assert early[1]()() == 1 and _RecordingCache.libraries == [3, 2]  # resolved early: this batch closed
    late = collector.add(["float*"], kernel(5))
    collector.close()
    assert late()() == kernel(5) == _FakeCache.built[-1]  # a batch of one: Inductor's own build


def test_the_hooks_stay_while_any_thread_is_inside_overlapped_and_torchs_come_back_after_the_last():
    """Two threads inside `pipeline.overlapped()`, the first to enter leaving first: the second keeps its hooks
    (its kernels batched, its waits deferred), and once both have left torch's own methods are back."""
    import threading

    from stampout.backends import pipeline
    from stampout.torch_internals import AsyncCompile, CppWrapperCodeCache, get_compile_threads

    originals = (AsyncCompile.wait, AsyncCompile.cpp_pybinding, CppWrapperCodeCache.__dict__.get("load_pybinding"))
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def first() -> None:
        with pipeline.overlapped():
            a_in.set()
            b_in.wait(30)
        a_out.set()

    def second() -> None:
        a_in.wait(30)
        with pipeline.overlapped():
            b_in.set()
            a_out.wait(30)
            seen["wait"], seen["batching"] = AsyncCompile.wait, pipeline.batches_kernels()
        seen["outside"] = pipeline.batches_kernels()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert seen["wait"] is pipeline._deferred_wait and seen["batching"] is (get_compile_threads() > 1) and seen["outside"] is False
    assert (AsyncCompile.wait, AsyncCompile.cpp_pybinding,
            CppWrapperCodeCache.__dict__.get("load_pybinding")) == originals
