"""Backends x (inference, training) x (flat, regions) against eager values and gradients.

Inductor compiles are slow on 2 cores: those cases are few, small and marked `inductor`.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import check_call, named_grads
from torch import nn

import stampout


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class RegionBlock(Block):
    forward = stampout.region(Block.forward)


class Net(nn.Module):
    def __init__(self, block=Block, n=3, d=16):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList([block(d) for _ in range(n)])

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


def check_backend(backend, block, train: bool, n: int = 3, rtol=1e-4, atol=1e-5):
    torch.manual_seed(0)
    model = Net(block, n)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 16)
    fn = stampout.compile(model, backend=backend)
    with torch.set_grad_enabled(train):  # (inference: the compiled output does not require grad, as eager's)
        check_call(reference, fn, x, grad=train, compiled_params_of=model, rtol=rtol, atol=atol)
    return fn


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("block", [Block, RegionBlock], ids=["flat", "regions"])
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_backend_matches_eager(backend, block, train):
    fn = check_backend(backend, block, train)
    assert fn.stats.captures == 1
    assert fn.stats.traces == (1 if block is RegionBlock else 0)


def test_custom_backend_callable_gets_the_graph_and_example_inputs():
    seen = {}

    def backend(gm, example_inputs):
        seen["gm"], seen["inputs"] = gm, example_inputs
        return gm

    fn = check_backend(backend, Block, train=False)
    assert isinstance(seen["gm"], torch.fx.GraphModule)
    assert all(isinstance(t, torch.Tensor) for t in seen["inputs"])
    assert fn.last_capture.gm is seen["gm"]


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(stampout.BackendError, match="unknown backend 'tvm'"):
        stampout.compile(Net(), backend="tvm")


def test_eager_backward_through_region_calls_works():
    """Plain eager backward through invoke_subgraph fails on torch 2.13; stampout's eager path must not."""
    check_backend("eager", RegionBlock, train=True)


@pytest.mark.inductor
def test_inductor_flat_and_regions_inference():
    check_backend("inductor", Block, train=False, n=2)
    fn = check_backend("inductor", RegionBlock, train=False, n=2)
    assert fn.stats.traces == 1


@pytest.mark.inductor
@pytest.mark.parametrize("glue", ["whole", "auto"], ids=["whole_graph", "regions_apart"])
def test_inductor_training_on_reused_regions_gives_eager_gradients(glue):
    """Regression test for torch 2.13's wrong gradients through reused subgraphs (TORCH_NOTES.md).

    On this llama-like stack, Inductor without stampout's workaround returns gradients 36 % off on
    layers.1.input_layernorm.weight when it compiles the whole graph (invoke_subgraph inside); with it they
    match eager. Fails if the workaround is removed. Compiled apart (the default for this stack), each
    region is a flat graph and its gradients must match eager as well.
    """
    from stampout.tools.models import LlamaConfig, LlamaLike

    assert stampout.config.avoid_reused_subgraph_buffer_bug
    torch.manual_seed(0)
    model = LlamaLike(LlamaConfig(layers=2), regions=True)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16))
    fn = stampout.compile(model, backend="inductor")
    with stampout.config.patch(glue=glue):
        out, expected = fn(ids), reference(ids)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        out.float().pow(2).mean().backward()
    expected.float().pow(2).mean().backward()
    got, want = named_grads(model), named_grads(reference)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-5,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")
    assert fn.stats.traces == 1


@pytest.mark.inductor
@pytest.mark.slow
def test_inductor_training_sd3_blocks_gives_eager_gradients():
    """Regression test for torch 2.13's CPU horizontal fusion bug (inductor.py's docstring).

    A 2-layer diffusers SD3 transformer, its blocks compiled apart: without stampout's workaround
    (cpp.max_horizontal_fusion_size=1) the JointTransformerBlock's compiled backward is off by ~0.4 %
    (pos_embed.proj.weight; torch.compile per block, as diffusers' compile_repeated_blocks, is off the same
    way); with it gradients match eager. Fails if the workaround is removed.
    """
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
    from bench.common import diffusers_model

    assert stampout.config.avoid_horizontal_fusion_bug
    model, kwargs, _ = diffusers_model("sd3", layers=2)
    model.train()
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="inductor", regions="auto")
    out, expected = fn(**kwargs)[0], reference(**kwargs)[0]
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    out.pow(2).mean().backward()
    expected.pow(2).mean().backward()
    got, want = named_grads(model), named_grads(reference)
    scale = max(g.norm() for g in want.values())
    for name in want:  # relative to the parameter's gradient, or to 1e-3 of the largest for ~zero ones
        error = (got[name] - want[name]).norm() / torch.maximum(want[name].norm(), 1e-3 * scale)
        assert error < 1e-4, f"grad of {name}: relative error {error:.2e}"


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_region_called_with_and_without_grad(backend):
    """A region traced under no_grad must not share its subgraph name with grad-mode calls (AOTAutograd
    keys subgraph traces by name; sharing one crashed its backward)."""
    @stampout.region
    def block(x, w):
        return (x @ w).sin()

    w = torch.randn(8, 8, requires_grad=True)

    def prog(x):
        with torch.no_grad():
            a = block(x, w)
        return block(a, w)

    x = torch.randn(4, 8)
    fn = stampout.compile(prog, backend=backend)
    out = fn(x)
    out.sum().backward()
    expected_grad = torch.autograd.grad(prog(x).sum(), w)[0]
    torch.testing.assert_close(w.grad, expected_grad)
    assert [e.outcome for e in fn.last_capture.events] == ["traced", "traced"]


def test_backend_failure_is_a_stampout_error():
    def broken(gm, example_inputs):
        raise ValueError("no kernels today")

    with pytest.raises(stampout.BackendError, match="no kernels today"):
        stampout.compile(Net(), backend=broken)(torch.randn(4, 16))


# ------------------------------------------------- inductor: regions compiled apart, caches, toolchain, timing


class SkipBlock(Block):
    def __init__(self, d=16):
        super().__init__(d)
        self.skip = nn.Linear(d, d)

    @stampout.region
    def forward(self, x):
        return self.down(F.gelu(self.up(self.ln(x)))) + self.skip(x)


class TransposedInput(nn.Module):
    """The first block gets a transposed (non-contiguous) activation, the others contiguous ones: two
    subgraphs that differ only in an operand's strides (as in diffusers' PixArt)."""

    def __init__(self, n=3, d=16):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList([SkipBlock(d) for _ in range(n)])

    def forward(self, x):
        x = self.inp(x).transpose(0, 1)
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_decoder_compiles_its_one_region_apart_with_eager_glue():
    from stampout.backends import split
    from stampout.tools.models import LlamaConfig, LlamaLike

    cap = stampout.capture(LlamaLike(LlamaConfig(layers=3), regions=True), torch.randint(0, 128, (2, 8)))
    assert split.reason_to_compile_whole(cap.gm) is None
    plans = split.plan(split.region_calls(cap.gm))
    assert len(plans) == 3 and len({id(p.compiled_as) for p in plans.values()}) == 1
    assert all(s is None for p in plans.values() for s in p.relayout)


def test_reasons_to_compile_the_whole_graph():
    from stampout.backends import split

    def thick(x):
        for _ in range(40):
            x = x.sin().cos()
        return RegionBlock()(x)

    assert "no region calls" in split.reason_to_compile_whole(stampout.capture(Net(), torch.randn(4, 16)).gm)
    assert "glue does real work" in split.reason_to_compile_whole(stampout.capture(thick, torch.randn(4, 16)).gm)

    @stampout.region
    def scale_(x, w):
        return x.mul_(2) @ w

    cap = stampout.capture(lambda x: scale_(x, x.t()), torch.randn(4, 4))  # operands share memory
    assert "write into its inputs" in split.reason_to_compile_whole(cap.gm, max_glue=float("inf"))
    cap = stampout.capture(lambda x, w: scale_(x.clone(), w), torch.randn(4, 4), torch.randn(4, 4, requires_grad=True))
    assert "require grad" in split.reason_to_compile_whole(cap.gm, max_glue=float("inf"))
    cap = stampout.capture(lambda x, w: scale_(x.clone(), w), torch.randn(4, 4), torch.randn(4, 4))
    assert split.reason_to_compile_whole(cap.gm, max_glue=float("inf")) is None  # separate, no grad: apart

    @stampout.region
    def interleave(x, w):  # writes only into a tensor it made (diffusers' Wan rotary embedding does this)
        out = torch.empty_like(x)
        out[..., 0::2] = x[..., 1::2]
        out[..., 1::2] = F.relu(x[..., 0::2] @ w, inplace=True)
        return out

    cap = stampout.capture(interleave, torch.randn(4, 4), torch.randn(2, 2))
    assert split.reason_to_compile_whole(cap.gm, max_glue=float("inf")) is None


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_glue_copies_an_operand_into_the_compiled_layout(train):
    """Subgraphs differing only in operand strides are compiled once; the odd call's operand is copied into
    the compiled layout. Checked with eager 'compiled' regions against eager values and gradients."""
    from stampout.backends import split
    from stampout.backends.runner import as_call_modules

    torch.manual_seed(0)
    model = TransposedInput()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 5, 16)
    with torch.set_grad_enabled(train):
        cap = stampout.capture(model, x)
        assert cap.stats.subgraphs == 2
        compiled = []
        glue = split.build(cap.gm, lambda call, vals: compiled.append(call) or as_call_modules(call.subgraph))
        assert len(compiled) == 1
        assert sum(n.target is split.relayout for n in glue.graph.nodes) == 1
        out, expected = glue(*cap.placeholders_for((x,), {}))[0], reference(x)
    torch.testing.assert_close(out, expected)
    if train:
        out.pow(2).mean().backward()
        expected.pow(2).mean().backward()
        got, want = named_grads(model), named_grads(reference)
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=lambda m, name=name: f"grad of {name}: {m}")


def test_lazy_isa_list_checks_candidates_only_as_far_as_it_is_read():
    from stampout.backends.toolchain import LazyIsaList

    checked = []

    class Isa:
        def __init__(self, name, ok):
            self.name, self.ok = name, ok

        def __bool__(self):
            checked.append(self.name)
            return self.ok

    isas = LazyIsaList([Isa("amx", False), Isa("avx512", True), Isa("avx2", True)])
    assert isas[0].name == "avx512" and checked == ["amx", "avx512"]
    assert bool(isas) and checked == ["amx", "avx512"]
    assert [i.name for i in isas] == ["avx512", "avx2"] and len(isas) == 2
    assert checked == ["amx", "avx512", "avx2"]


def test_isa_verdicts_are_remembered_in_the_cache_dir(tmp_path, monkeypatch):
    from stampout.backends import store, toolchain

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    runs = []

    class VecFake:
        def build_arch_flags(self):
            return "-mfake"

    monkeypatch.setattr(toolchain, "_original_check_build", lambda isa, code: runs.append(code) or True)
    monkeypatch.setattr(toolchain, "_stored", None)
    assert toolchain._check_build(VecFake(), "int main() {}") is True
    monkeypatch.setattr(toolchain, "_stored", None)  # as a new process on the same cache dir
    assert toolchain._check_build(VecFake(), "int main() {}") is True
    assert runs == ["int main() {}"]
    assert list(store.load("vec_isa").values()) == [True]
    assert store.directory().startswith(str(tmp_path))


def test_timing_phases_are_exclusive_and_add_up():
    from stampout.backends import timing

    with timing.record("work") as rec:
        with timing.phase("outer"):
            sum(range(20000))
            with timing.phase("inner"):
                sum(range(20000))
    assert set(rec.seconds) <= {"outer", "inner", "other"} and {"outer", "inner"} <= set(rec.seconds)
    assert sum(rec.seconds.values()) == pytest.approx(rec.wall, abs=1e-3)
    assert timing.RECORDS[-1] is rec


class CacheLayer(nn.Module):
    """A static KV cache's write: index_copy_ into buffers the region is handed, then attention over them."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    @stampout.region
    def forward(self, x, keys, pos):
        keys.index_copy_(1, pos, self.proj(x))
        return x + keys.sum(1, keepdim=True)


class CacheStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(CacheLayer() for _ in range(3))

    def forward(self, x, caches, pos):
        for layer, keys in zip(self.layers, caches):
            x = layer(x, keys, pos)
        return x


@pytest.mark.inductor
def test_regions_writing_a_static_cache_compile_apart_and_update_it():
    from stampout.backends import split

    model = CacheStack()
    caches, expected_caches = [torch.zeros(2, 6, 8) for _ in range(3)], [torch.zeros(2, 6, 8) for _ in range(3)]
    fn = stampout.compile(model, backend="inductor")
    for step in range(3):
        x, pos = torch.randn(2, 1, 8), torch.tensor([step])
        with torch.no_grad():
            got, expected = fn(x, caches, pos), model(x, expected_caches, pos)
        torch.testing.assert_close(got, expected)
        for a, b in zip(caches, expected_caches):
            torch.testing.assert_close(a, b)
    assert fn.stats.captures == 1
    with torch.no_grad():
        assert split.reason_to_compile_whole(fn.last_capture.gm) is None  # the regions were compiled apart
