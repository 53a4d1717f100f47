"""stampout.compile as a drop-in for torch.compile: the module it returns, its keywords, arguments refused at
once, the command line without torch, and repr sizes."""

from __future__ import annotations

import copy
import logging
import os
import random
import subprocess
import sys

import pytest
import torch
from helpers import tree_assert_close
from torch import nn

import stampout
from stampout.backends import timing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.norm = nn.BatchNorm1d(8)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.norm(x) * self.scale


def pair() -> tuple[Net, Net]:
    torch.manual_seed(0)
    model = Net()
    return model, copy.deepcopy(model)


def test_compiled_module_is_the_model():
    model, reference = pair()
    fast = stampout.compile(model, backend="eager")
    assert isinstance(fast, nn.Module) and fast._orig_mod is model
    assert list(fast.state_dict()) == list(model.state_dict())
    assert [n for n, _ in fast.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(fast.parameters(), model.parameters()))
    assert [n for n, _ in fast.named_buffers()] == [n for n, _ in model.named_buffers()]
    assert fast.layers is model.layers  # attributes read through the wrapper
    x = torch.randn(4, 8)
    tree_assert_close(fast(x), reference(x))
    tree_assert_close(model.norm.running_mean, reference.norm.running_mean)  # the world as eager leaves it
    assert fast.stats.captures == 1 and fast.last_capture is not None
    assert {"guard_code", "explain", "stats", "last_capture"} <= set(dir(fast))  # (tab completion finds them)
    assert "def check(" in fast.guard_code()


def test_load_state_dict_goes_into_the_original():
    model, _ = pair()
    fast = stampout.compile(model, backend="eager")
    other = Net()
    fast.load_state_dict(other.state_dict())
    assert torch.equal(model.layers[0].weight, other.layers[0].weight)
    x = torch.randn(4, 8)
    tree_assert_close(fast(x), other(x.clone()))


def test_train_eval_to_act_on_the_original():
    model, reference = pair()
    fast = stampout.compile(model, backend="eager")
    assert fast.eval() is fast and not model.training and not model.norm.training and not fast.training
    x = torch.randn(4, 8)
    tree_assert_close(fast(x), reference.eval()(x))
    fast.train()
    assert model.training and model.norm.training
    fast.to(torch.float64)
    assert model.layers[0].weight.dtype == torch.float64
    out = fast(x.double())
    assert out.dtype == torch.float64
    tree_assert_close(out, reference.train().double()(x.double()))
    assert fast.stats.captures == 2  # eval, then train in float64


def test_hooks_registered_on_the_wrapper_run():
    model, reference = pair()
    fast = stampout.compile(model, backend="eager")
    seen = []
    handle = fast.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    pre = fast.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    x = torch.randn(4, 8)
    tree_assert_close(fast(x), reference(x * 2))
    assert seen == [torch.Size([4, 8])]
    handle.remove()
    pre.remove()
    fast(x)
    assert seen == [torch.Size([4, 8])]


def test_attributes_written_through_the_wrapper():
    model, _ = pair()
    fast = stampout.compile(model, backend="eager")
    fast.max_entries = 2
    assert fast._compiled.max_entries == 2
    fast.note = "x"
    assert model.note == "x"


def test_training_gradients_match_eager():
    model, reference = pair()
    fast = stampout.compile(model, backend="aot_eager")
    x = torch.randn(4, 8)
    fast(x).sum().backward()
    reference(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        tree_assert_close(p.grad, q.grad, name)


def test_functions_and_methods_stay_compiled_functions():
    model, _ = pair()
    assert type(stampout.compile(model.forward, backend="eager")) is stampout.CompiledFunction
    assert type(stampout.compile(torch.sin, backend="eager")) is stampout.CompiledFunction


def test_deepcopy_of_a_compiled_module_compiles_the_copy():
    model, reference = pair()
    fast = stampout.compile(model, backend="eager")
    x = torch.randn(4, 8)
    fast(x)
    twin = copy.deepcopy(fast)
    assert isinstance(twin, stampout.CompiledModule) and twin._orig_mod is not model
    assert twin.stats.captures == 0
    tree_assert_close(twin(x), reference(x))


def test_deepcopy_of_a_model_whose_forward_is_compiled_compiles_the_copy():
    # The Hugging Face recipe `model.forward = stampout.compile(model.forward)`, then `copy.deepcopy(model)` (an EMA
    # or reference twin): the copy's forward is compiled afresh and runs the copy (was: TypeError, cannot pickle
    # 'module' object, from deep-copying the compiled function's state).
    model, reference = pair()
    model.eval(), reference.eval()
    model.forward = stampout.compile(model.forward, backend="eager")
    x = torch.randn(4, 8)
    tree_assert_close(model(x), reference(x))
    twin = copy.deepcopy(model)
    assert isinstance(twin.forward, stampout.CompiledFunction) and twin.forward.fn.__self__ is twin
    assert twin.forward.stats.captures == 0
    with torch.no_grad():
        twin.layers[0].weight.mul_(2)
        reference.layers[0].weight.mul_(2)
    tree_assert_close(twin(x), reference(x))
    assert not torch.equal(model(x), twin(x))  # the original still runs its own weights


def test_disable_runs_eagerly():
    model, reference = pair()
    fast = stampout.compile(model, disable=True)
    x = torch.randn(4, 8)
    tree_assert_close(fast(x), reference(x))
    assert fast.stats.captures == 0 and fast.last_capture is None
    fn = stampout.compile(lambda t: t.sin(), disable=True)
    assert torch.equal(fn(x), x.sin()) and fn.stats.captures == 0


RNG = random.Random(0)


def noisy(x):
    return x * RNG.random()  # a Random's state cannot be guarded: compile runs such calls eagerly


def test_fullgraph_is_stored_and_refuses_eager_fallback():
    fn = stampout.compile(noisy, backend="eager", fullgraph=True)
    assert fn.fullgraph is True
    with pytest.raises(stampout.CaptureError, match="fullgraph=True") as info:
        fn(torch.randn(3))
    assert "test_dropin.py" in str(info.value)
    lenient = stampout.compile(noisy, backend="eager")
    assert lenient.fullgraph is False
    assert lenient(torch.ones(2)).shape == (2,)  # ran eagerly
    assert lenient.last_capture is None


@pytest.mark.parametrize("mode", [None, "default", "reduce-overhead", "max-autotune",
                                  "max-autotune-no-cudagraphs"])
def test_modes_are_accepted(mode):
    fn = stampout.compile(torch.sin, mode=mode)
    assert fn.mode == mode


def test_options_are_inductor_config_patches():
    from stampout.backends.options import with_patches

    seen = []

    def backend(gm, example_inputs):
        from torch._inductor import config

        seen.append(config.max_autotune)
        return gm

    compiled = with_patches(backend, {"max_autotune": True})
    fn = stampout.compile(lambda t: t + 1, backend=compiled)
    assert torch.equal(fn(torch.ones(2)), torch.full((2,), 2.0))
    assert seen == [True]


@pytest.mark.parametrize("call, match", [
    (lambda: stampout.capture(42), "needs a function, method or nn.Module, got int"),
    (lambda: stampout.capture(None, torch.ones(1)), "got NoneType"),
    (lambda: stampout.compile(None), "got NoneType"),
    (lambda: stampout.compile(torch.sin, backend="nope"), "unknown backend 'nope'"),
    (lambda: stampout.compile(torch.sin, mode="fast"), "unknown mode 'fast'"),
    (lambda: stampout.compile(torch.sin, mode="max-autotune", options={"max_autotune": True}), "both mode"),
    (lambda: stampout.compile(torch.sin, options={"max_autotun": True}), "did you mean"),
    (lambda: stampout.compile(torch.sin, backend="eager", mode="max-autotune"), "configure Inductor"),
    (lambda: stampout.compile(torch.sin, options=[1]), "options must be a dict"),
    (lambda: stampout.compile(torch.sin, fullgraph="yes"), "fullgraph must be True or False"),
    (lambda: stampout.compile(torch.sin, max_entries=0), "max_entries must be a positive int"),
    (lambda: stampout.compile(torch.sin, dynamic="sometimes"), "dynamic must be None, True or False"),
    (lambda: stampout.capture(nn.Linear(2, 2)), r"do not fit Linear.forward\(input: torch.Tensor\) -> "
     r"torch.Tensor: missing a required argument: 'input'"),
    (lambda: stampout.explain(stampout.compile(nn.Linear(2, 2), backend="eager")),  # (a compiled module: its model's)
     r"do not fit Linear.forward\(input: torch.Tensor\)"),
    (lambda: stampout.export(nn.Linear(2, 2), torch.ones(2), torch.ones(2)), "too many positional arguments"),
    (lambda: stampout.export(None, torch.ones(1)), "stampout.export needs a function"),
    (lambda: stampout.region(max_reuse_entries=0), "max_reuse_entries must be a positive int, got 0"),
    (lambda: stampout.region(reuse_hash_fn=3), "reuse_hash_fn must be a callable"),
    (lambda: stampout.region(42), "needs a Python function or an nn.Module, got int"),
])
def test_bad_arguments_are_refused_at_once(call, match):
    with pytest.raises(stampout.StampoutError, match=match) as info:
        call()
    lines = str(info.value).splitlines()
    assert "test_dropin.py" in lines[1] and lines[-1].startswith("  fix: ")


def test_repr_is_a_few_lines():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    x = torch.randn(2, 64)
    cap = stampout.capture(model, x)
    fn = stampout.compile(model.forward, backend="eager")
    fn(x)
    for text in (repr(cap), repr(fn)):
        assert len(text.splitlines()) <= 6 and len(text) < 600 and "tensor(" not in text
    assert repr(fn).startswith("CompiledFunction(Sequential.forward, backend=eager")
    assert "captures=1" in repr(fn)
    assert repr(stampout.compile(model, backend="eager")).startswith("CompiledModule(Sequential")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**ENV, **env})


def test_help_and_version_do_not_import_torch():
    code = ("import sys\nfrom stampout.cli import main\nfor argv in (['--version'], ['--help'], ['demo', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\nprint('torch' in sys.modules)")
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith("stampout 0.")
    assert "--layers" in result.stdout
    assert result.stdout.splitlines()[-1] == "False"


def test_unknown_stampout_logs_names_are_refused():
    result = _run("import stampout", STAMPOUT_LOGS="+regions,bogus")
    assert result.returncode != 0
    assert "StampoutError: STAMPOUT_LOGS='+regions,bogus': unknown name bogus" in result.stderr
    assert "regions, guards, capture, backends, timing, breaks, all" in result.stderr
    assert _run("import stampout", STAMPOUT_LOGS="+regions,guards,all").returncode == 0


def test_public_names_survive_importing_submodules_first():
    # `stampout.capture` and `stampout.export` are submodules too; the package loads lazily (for --help)
    result = _run("from stampout.capture.result import Capture\nimport stampout.export.program\nimport stampout\n"
                  "print(callable(stampout.capture), callable(stampout.export), stampout.Capture is Capture)")
    assert result.stdout.split() == ["True", "True", "True"], result.stderr


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_export_refuses_dynamic_shapes_keys_that_name_no_argument():
    from torch.export import Dim

    with pytest.raises(stampout.ExportError, match="names 'input_ids', which is not an argument of "
                       "Stack.forward; its arguments: x, mask") as info:
        stampout.export(Stack(), torch.randn(4, 8), dynamic_shapes={"input_ids": {0: Dim("b")}})
    assert "test_dropin.py" in str(info.value).splitlines()[1]


def test_export_with_automatic_regions():
    from torch.export import Dim

    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(4, 8)
    ep = stampout.export(model, x, dynamic_shapes={"x": {0: Dim("b", min=2, max=64)}}, regions="auto")
    calls = ep.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
    assert len(calls) == 3
    assert [name for name, _ in ep.graph_module.named_children()] == ["repeated_subgraph0"]
    y = torch.randn(7, 8)
    tree_assert_close(ep.module()(y), model(y))
    assert type(model.layers[0]) is Block  # the marking is undone
    plain = stampout.export(model, x)
    assert not plain.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
    with pytest.raises(stampout.ExportError, match="regions must be None or 'auto'"):
        stampout.export(model, x, regions="all")


class ShapeBug(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h @ x  # (2, 4) @ (2, 8)


def test_a_shape_bug_is_reported_as_eager_reports_it(capfd):
    model = ShapeBug()
    with pytest.raises(RuntimeError) as eager:
        model(torch.randn(2, 8))
    capfd.readouterr()
    with pytest.raises(stampout.CaptureError) as info:
        stampout.capture(model, torch.randn(2, 8))
    lines = str(info.value).splitlines()
    assert lines[0] == (f"RuntimeError in matmul: {eager.value} (inputs: Tensor[2, 4] float32, Tensor[2, 8] "
                        "float32)")
    assert lines[1] == "  code: return h @ x  # (2, 4) @ (2, 8)"
    assert "test_dropin.py" in lines[2] and "in forward" in lines[2]
    err = capfd.readouterr().err
    assert "fake_tensor.py" not in err and "failed while attempting to run meta" not in err


def test_a_custom_op_without_a_fake_kernel_is_explained():
    @torch.library.custom_op("stampout_test::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def program(x):
        return twice(x).sin()

    with pytest.raises(stampout.CaptureError, match=r"has no fake \(meta\) kernel") as info:
        stampout.capture(program, torch.randn(3))
    text = str(info.value)
    assert "test_dropin.py" in text and 'register_fake("stampout_test::twice")' in text

    @twice.register_fake
    def _(x):
        return torch.empty_like(x)

    cap = stampout.capture(program, torch.randn(3))
    x = torch.randn(3)
    tree_assert_close(cap(x), (x * 2).sin())


def test_a_compiled_function_inside_a_capture_names_the_users_line():
    inner = stampout.compile(lambda x: x.sin(), backend="eager")

    def outer(x):
        return inner(x) + 1

    with pytest.raises(stampout.CaptureError, match="while another capture runs") as info:
        stampout.capture(outer, torch.randn(3))
    assert "test_dropin.py" in str(info.value).splitlines()[1]


class Growing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.lin(input_ids)
        return h * 2 if h.shape[1] > 4 else h


def test_guard_log_lines_are_short_and_name_the_users_dims(caplog):
    torch.manual_seed(0)
    model = Growing()
    fn = stampout.compile(model, backend="eager", dynamic=True)
    with caplog.at_level(logging.INFO, logger="stampout"):
        for n in (6, 7, 3):
            x = torch.randn(2, n, 8)
            tree_assert_close(fn(x), model(x))
        timing.RECORDS.clear()
        with caplog.at_level(logging.INFO, logger="stampout.timing"):
            fn(torch.randn(2, 3, 8, 2)[..., 0])  # a new stride: recaptured
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("stampout.")]
    assert "guard failed for Growing: the symbolic capture assumed 5 <= input_ids.size(1); capturing again" in lines
    assert not any("s0" in line or "s1" in line or "size()[" in line for line in lines), lines
    assert all(len(line) < 700 for line in lines)
    assert any(line.startswith("capture: Growing: ") for line in lines)
    assert any(r.what == "capture: Growing" and "capture" in r.seconds for r in timing.RECORDS)


def test_a_structure_difference_is_cut_short():
    from stampout.regions.fingerprint import Fingerprint, describe_difference, state_key

    a = Fingerprint(((("list", tuple(range(200))),), ()), (), state_key(), ())
    b = Fingerprint(((("list", tuple(range(201))),), ()), (), state_key(), ())
    text = describe_difference(a, b, [])
    assert text.startswith("argument structure differs: expected ((") and len(text) < 400


@pytest.mark.slow
def test_the_wheel_holds_every_module_and_the_command(tmp_path):
    """`pip install .` (not editable) installs what a build puts in the wheel: every module under src/."""
    import zipfile

    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(tmp_path), ROOT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = tmp_path.glob("stampout-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    src = os.path.join(ROOT, "src")
    for folder, _, files in os.walk(os.path.join(src, "stampout")):
        for name in files:
            if name.endswith(".py"):
                assert os.path.relpath(os.path.join(folder, name), src) in names
    (entry,) = [n for n in names if n.endswith("entry_points.txt")]
    assert "stampout = stampout.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
    (meta,) = [n for n in names if n.endswith("METADATA")]
    assert "Requires-Dist: torch<2.15,>=2.13" in zipfile.ZipFile(wheel).read(meta).decode()


def _private_torch_names_in_source() -> set[str]:
    """Every private torch name the package's code names, torch_internals.py included (size_report's scanner)."""
    import ast
    import pathlib

    import size_report

    return {n for path in pathlib.Path(ROOT, "src", "stampout").rglob("*.py")
            for n in size_report.private_torch_names(ast.parse(path.read_text()))}


def test_every_private_torch_name_is_declared_and_exists_in_this_torch():
    from stampout import torch_internals

    declared = torch_internals.PRIVATE_NAMES
    undeclared = sorted(n for n in _private_torch_names_in_source()
                        if not any(n == d or n.startswith(d + ".") or d.startswith(n + ".") for d in declared))
    assert not undeclared, f"add these to torch_internals.PRIVATE_NAMES: {undeclared}"
    assert torch_internals.missing_private_names() == [], torch.__version__
    assert torch_internals.VERSION in torch_internals.SUPPORTED


class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale=2.0):
        ctx.scale = scale
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale * 10, None  # a backward eager would not derive: it must be the user's


def test_autograd_function_apply_is_patched_and_restored():
    before = dict(torch.autograd.Function.__dict__).get("apply")
    x = torch.randn(3, requires_grad=True)
    cap = stampout.capture(lambda t: Twice.apply(t).sin(), x)
    assert dict(torch.autograd.Function.__dict__).get("apply") is before  # 2.13: the classmethod; 2.14: absent
    y = x.detach().clone().requires_grad_()
    cap(y).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    Twice.apply(x2).sin().sum().backward()
    tree_assert_close(y.grad, x2.grad)


def test_progress_line_on_a_terminal_only():
    import io
    import time

    from stampout import config
    from stampout.backends import progress

    terminal = io.StringIO()
    with config.patch(progress_delay=0.0), progress.compiling("Net", stream=terminal, force=True) as line:
        progress.expect(2)
        progress.compiled()
        progress.compiled(from_cache=True)
        deadline = time.monotonic() + 10
        while not line.shown and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.6)  # a refresh or two
    assert "stampout: compiling Net: 2/2 graphs, 1 from the cache" in terminal.getvalue()
    assert progress.current() is None
    pipe = io.StringIO()  # not a terminal: nothing, ever
    with progress.compiling("Net", stream=pipe):
        progress.compiled()
        time.sleep(0.3)
    assert pipe.getvalue() == ""
    progress.compiled()  # no compile open: nothing to count, no error


def test_a_compiled_child_keeps_its_parents_state_dict():
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Linear(8, 8), Net())
    reference = copy.deepcopy(parent)
    keys = list(parent.state_dict())
    parent[1] = stampout.compile(parent[1], backend="eager")
    assert list(parent.state_dict()) == keys
    other = nn.Sequential(nn.Linear(8, 8), Net())
    parent.load_state_dict(other.state_dict())  # strict: every key lands in the original
    assert torch.equal(parent[1]._orig_mod.layers[2].weight, other[1].layers[2].weight)
    reference.load_state_dict(other.state_dict())
    x = torch.randn(4, 8)
    tree_assert_close(parent(x), reference(x))
    parent.zero_grad()
    parent.double()
    assert parent[1]._orig_mod.scale.dtype == torch.float64
