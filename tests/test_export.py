"""stampout.export: ExportedPrograms that keep regions as invoke_subgraph over shared subgraphs."""

from __future__ import annotations

import copy
import inspect
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim
from torch.export.graph_signature import InputKind

import stampout
from stampout.export.program import ExportError
from stampout.tools.models import LlamaConfig, LlamaLike

INVOKE = torch.ops.higher_order.invoke_subgraph
TINY = {"hidden": 16, "heads": 2, "kv_heads": 1, "intermediate": 32, "vocab": 32}


def ids(batch: int = 2, seq: int = 8, vocab: int = 32) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def llama(layers: int, **overrides: object) -> LlamaLike:
    return LlamaLike(LlamaConfig(layers=layers, **{**TINY, **overrides}), regions=True).eval()


def invokes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return gm.graph.find_nodes(op="call_function", target=INVOKE)


def subgraph_names(ep: torch.export.ExportedProgram) -> set[str]:
    return {node.args[0].target for node in invokes(ep.graph_module)}


def here() -> str:
    frame = inspect.currentframe().f_back
    return f"{__file__}:{frame.f_lineno}"


# ------------------------------------------------------------------------------------------- structure


def test_layers_share_one_subgraph_and_match_eager():
    model, x = llama(4), ids()
    ep = stampout.export(model, x)
    assert len(invokes(ep.graph_module)) == 4
    assert subgraph_names(ep) == {"repeated_subgraph0"}
    assert [n for n, _ in ep.graph_module.named_children()] == ["repeated_subgraph0"]
    ep.graph_module.graph.lint()
    torch.testing.assert_close(ep.module()(x), model(x), rtol=0, atol=0)


def test_signature_uses_state_dict_names():
    model, x = llama(2), ids()
    ep = stampout.export(model, x)
    sig = ep.graph_signature
    assert list(sig.parameters) == [name for name, _ in model.named_parameters()]
    assert list(sig.buffers) == ["rotary.inv_freq"]
    inv_freq = next(s for s in sig.input_specs if s.kind is InputKind.BUFFER)
    assert inv_freq.persistent is False and "rotary.inv_freq" in ep.constants  # as torch.export does it
    assert list(sig.user_inputs) == ["input_ids"]
    placeholders = [n.name for n in ep.graph.find_nodes(op="placeholder")]
    assert placeholders[0] == "p_embed_tokens_weight" and placeholders[-2:] == ["b_rotary_inv_freq", "input_ids"]
    sub = ep.graph_module.repeated_subgraph0
    assert [n.name for n in sub.graph.find_nodes(op="placeholder")][:3] == ["hidden", "cos", "sin"]
    node = next(n for n in sub.graph.nodes if n.target is torch.ops.aten.rsqrt.default)
    assert "llama.py" in node.meta["stack_trace"]  # the user's line survives lowering
    assert set(ep.state_dict) == set(model.state_dict())


def test_divergent_layers_get_their_own_subgraph():
    model, x = llama(4), ids()
    model.layers[2].input_layernorm.eps = 1e-2  # read by the region: layer 2 traces again
    ep = stampout.export(model, x)
    calls = invokes(ep.graph_module)
    assert len(calls) == 4 and len(subgraph_names(ep)) == 2
    assert calls[0].args[0].target == calls[1].args[0].target == calls[3].args[0].target != calls[2].args[0].target
    torch.testing.assert_close(ep.module()(x), model(x), rtol=0, atol=0)


def test_training_mode_export():
    model, x = llama(3).train(), ids()
    ep = stampout.export(model, x)
    assert len(invokes(ep.graph_module)) == 3 and len(subgraph_names(ep)) == 1
    out = ep.module()(x)
    assert out.requires_grad
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.lin(x)))


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        for block in self.blocks:
            x = block(x)
        return x


def test_batchnorm_eval_and_training_buffer_updates():
    torch.manual_seed(0)
    model, x = BatchNormNet().eval(), torch.randn(4, 8)
    ep = stampout.export(model, x)
    assert len(subgraph_names(ep)) == 1 and "blocks.1.bn.running_mean" in ep.graph_signature.buffers
    torch.testing.assert_close(ep.module()(x), model(x))

    model.train()
    reference = copy.deepcopy(model)
    with torch.no_grad():  # in-place buffer updates inside a region need grad off (torch 2.13 invoke_subgraph)
        ep = stampout.export(model, x)
        program = ep.module()
        torch.testing.assert_close(program(x), reference(x))
    for name in ("norm.running_mean", "blocks.2.bn.running_var", "blocks.0.bn.num_batches_tracked"):
        torch.testing.assert_close(program.state_dict()[name], reference.state_dict()[name])


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Inner(), Inner()

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) + x


def test_nested_regions_stay_nested():
    model, x = nn.Sequential(*[Outer() for _ in range(3)]), torch.randn(2, 8)
    ep = stampout.export(model, x)
    assert len(invokes(ep.graph_module)) == 3 and subgraph_names(ep) == {"repeated_subgraph0"}
    outer = ep.graph_module.repeated_subgraph0
    assert len(invokes(outer)) == 2 and list(outer._modules) == ["repeated_subgraph0"]
    torch.testing.assert_close(ep.module()(x), model(x), rtol=0, atol=0)


def test_function_with_constants_kwargs_and_pytree_output():
    weight = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))

    @stampout.region
    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight)

    def program(x: torch.Tensor, scale: float = 2.0, *, extra: object = None) -> dict:
        return {"y": block(block(x)) * scale, "rest": (x.sum(), None, 3)}

    x = torch.randn(2, 8)
    ep = stampout.export(program, x, scale=2.0, extra=None)
    assert len(invokes(ep.graph_module)) == 2 and len(subgraph_names(ep)) == 1
    kinds = [s.kind for s in ep.graph_signature.input_specs]
    assert kinds == [InputKind.CONSTANT_TENSOR, *[InputKind.USER_INPUT] * 3]  # x, scale, extra (None is a leaf)
    got, want = ep.module()(x, scale=2.0, extra=None), program(x)
    assert got["rest"][1:] == (None, 3)
    torch.testing.assert_close(got["y"], want["y"])
    torch.testing.assert_close(got["rest"][0], want["rest"][0])


def test_hugging_face_llama_vmap_masks_and_grad_sections():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
    for layer in model.model.layers:
        stampout.region(layer)
    x = ids()
    ep = stampout.export(model, input_ids=x, use_cache=False)
    assert len(invokes(ep.graph_module)) == 3 and subgraph_names(ep) == {"repeated_subgraph0"}
    assert torch._C._functorch.maybe_current_level() is None  # the mask's vmap levels were replayed, not leaked
    got = ep.module()(input_ids=x, use_cache=False)
    assert type(got).__name__ == "CausalLMOutputWithPast"
    torch.testing.assert_close(got.logits, model(input_ids=x, use_cache=False).logits, rtol=0, atol=0)


def test_save_and_load_in_a_fresh_process_without_stampout(tmp_path):
    """A static program and one with a dim range (run at another length than the example's), saved, then loaded
    and run in one fresh process that never imports stampout (one interpreter for both: its start is the cost)."""
    model = llama(3)
    cases = {}
    for name, dynamic in (("static", False), ("dim_range", True)):
        ep = stampout.export(model, ids(), dynamic_shapes={"input_ids": {1: Dim("t", max=32)}} if dynamic else None)
        torch.export.save(ep, tmp_path / f"{name}.pt2")
        cases[name] = ids(seq=13) if dynamic else ids()  # (the dim range: another length than the example's)
        torch.save(cases[name], tmp_path / f"{name}_x.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        for name in {list(cases)!r}:
            ep = torch.export.load(f"{{name}}.pt2")
            calls = ep.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
            assert len(calls) == 3 and len({{c.args[0].target for c in calls}}) == 1, (name, calls)
            torch.save(ep.module()(torch.load(f"{{name}}_x.pt")), f"{{name}}_out.pt")
        assert "stampout" not in sys.modules
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, x in cases.items():
        torch.testing.assert_close(torch.load(tmp_path / f"{name}_out.pt"), model(x), rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------------------------------------- errors


def test_dim_ranges_are_exported_and_honoured(tmp_path):
    model = llama(3)
    x = ids()
    ep = stampout.export(model, x, dynamic_shapes={"input_ids": {1: Dim("t", min=2, max=64)}})
    assert len(invokes(ep.graph_module)) == 3 and subgraph_names(ep) == {"repeated_subgraph0"}
    [(symbol, bounds)] = ep.range_constraints.items()
    assert (int(bounds.lower), int(bounds.upper)) == (2, 64)
    for length in (5, 8, 17, 64):
        y = ids(seq=length)
        torch.testing.assert_close(ep.module()(y), model(y), rtol=0, atol=0)
    with pytest.raises(AssertionError, match="<= 64"):
        ep.module()(ids(seq=65))
    with pytest.raises(AssertionError, match=r"size\(\)\[0\] == 2"):  # the batch dim stayed static
        ep.module()(ids(batch=3))
    torch.export.save(ep, tmp_path / "model.pt2")
    y = ids(seq=11)
    loaded = torch.export.load(tmp_path / "model.pt2")
    torch.testing.assert_close(loaded.module()(y), model(y), rtol=0, atol=0)


def test_dim_dynamic_hint_and_mark_dynamic_export_symbolic():
    model, x = llama(2), ids()
    for spec in (({1: Dim.DYNAMIC},), None):
        y = x.clone()
        if spec is None:
            torch._dynamo.mark_dynamic(y, 1)
        ep = stampout.export(model, y, dynamic_shapes=spec)
        assert len(ep.range_constraints) == 1 and subgraph_names(ep) == {"repeated_subgraph0"}
        z = ids(seq=13)
        torch.testing.assert_close(ep.module()(z), model(z), rtol=0, atol=0)


def test_static_specs_and_errors():
    model, x = llama(2), ids()
    with pytest.raises(ExportError, match="the size 3"):
        stampout.export(model, x, dynamic_shapes=((3, 8),))
    with pytest.raises(ExportError, match=r"range \[10, 20\]"):
        stampout.export(model, x, dynamic_shapes={"input_ids": {1: Dim("t", min=10, max=20)}})
    for fine in ({"input_ids": (Dim.AUTO, Dim.STATIC)}, ((2, None),), None):
        ep = stampout.export(model, x, dynamic_shapes=fine)
        assert ep.range_constraints == {}


def test_a_dim_the_program_specializes_is_refused():
    def needs_eight(x: torch.Tensor) -> torch.Tensor:
        return x.view(2, 8) * 2 if x.shape[1] == 8 else x

    with pytest.raises(ExportError, match="specializes it to 8") as info:
        where = here(); stampout.export(needs_eight, torch.randn(2, 8), dynamic_shapes=({1: Dim("t")},))  # noqa: E702
    assert where in str(info.value)


def test_unsupported_input_and_output_name_the_caller():
    class Config:
        scale = 2.0

    def takes_object(x: torch.Tensor, config: Config) -> torch.Tensor:
        return x * config.scale

    with pytest.raises(ExportError, match="input config is a Config") as info:
        where = here(); stampout.export(takes_object, torch.randn(2), Config())  # noqa: E702
    assert where in str(info.value)

    def returns_object(x: torch.Tensor) -> tuple:
        return x + 1, Config

    with pytest.raises(ExportError, match="returns a type"):
        stampout.export(returns_object, torch.randn(2))


def test_region_mutating_buffers_with_grad_names_the_region_call():
    model = BatchNormNet().train()
    with pytest.raises(ExportError, match="writes its inputs in place") as info:
        stampout.export(model, torch.randn(4, 8))
    assert f"{__file__}:" in str(info.value) and "torch.no_grad()" in str(info.value)


def test_data_dependent_python_is_a_stampout_error():
    def branchy(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum() > 0 else x

    with pytest.raises(stampout.StampoutError, match="data-dependent"):
        stampout.export(branchy, torch.randn(3))


# ----------------------------------------------------------------------------------------- AOTInductor


@pytest.mark.inductor
def test_aoti_package_compiles_each_region_once(tmp_path, monkeypatch):
    from torch._inductor.graph import GraphLowering

    model, x = llama(3, hidden=8, heads=2, kv_heads=1, intermediate=16), ids(1, 4)
    model.layers[1].input_layernorm.eps = 1e-3  # two distinct regions: [0, 2] and [1]
    ep = stampout.export(model, x)
    assert len(subgraph_names(ep)) == 2
    lowered: list[str] = []
    make_subgraph = GraphLowering.make_subgraph

    def counting(self: GraphLowering, gm: torch.fx.GraphModule, example_inputs: list, subgraph_name: str) -> object:
        lowered.append(subgraph_name)
        return make_subgraph(self, gm, example_inputs, subgraph_name)

    monkeypatch.setattr(GraphLowering, "make_subgraph", counting)
    with torch._inductor.config.patch(force_disable_caches=True, compile_threads=1):
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "model.pt2"))
    assert len(lowered) == 2, lowered  # one lowering per distinct region, not per call
    runner = torch._inductor.aoti_load_package(path)
    torch.testing.assert_close(runner(x), model(x))

    torch.save(x, tmp_path / "x.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        runner = torch._inductor.aoti_load_package({path!r})
        torch.save(runner(torch.load({str(tmp_path / "x.pt")!r})), {str(tmp_path / "out.pt")!r})
        assert "stampout" not in sys.modules
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), model(x))


# ------------------------------------------------------------------------------------ stamped-out lowering


class PassThrough(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    @stampout.region
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.relu(self.lin(x)) * mask  # x passes through; mask reaches the graph only through regions


class PassThroughNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PassThrough() for _ in range(3))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
        kept = []
        for block in self.blocks:
            residual, x = block(x, mask)
            kept.append(residual)
        return x + sum(kept)


class ViewOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    @stampout.region
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.view(-1), x * self.scale  # the first output aliases the region's input


def _view_out_net() -> nn.Module:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(ViewOut() for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            flat = []
            for block in self.blocks:
                v, x = block(x)
                flat.append(v.sum())
            return x * sum(flat)

    return Net()


def _divergent_llama() -> LlamaLike:
    model = llama(4)
    model.layers[2].input_layernorm.eps = 1e-2
    return model


STAMP_CASES = {
    "llama_two_regions": lambda: (_divergent_llama(), (ids(),)),
    "nested_regions": lambda: (nn.Sequential(*[Outer() for _ in range(3)]), (torch.randn(2, 8),)),
    "pass_through_and_region_only_input": lambda: (PassThroughNet(), (torch.randn(2, 8), torch.ones(2, 8),
                                                                      torch.randn(3))),
    "output_aliasing_the_input": lambda: (_view_out_net(), (torch.randn(2, 8),)),
}


def _graph_facts(ep: torch.export.ExportedProgram) -> list:
    """Everything about the program's graphs a consumer reads: code, node names, targets, values' metadata."""
    facts = []
    for name, module in ep.graph_module.named_modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        facts.append((name, module.code))
        for node in module.graph.nodes:
            vals = node.meta.get("val")
            metas = [(tuple(v.shape), v.stride(), v.dtype, v.requires_grad) if isinstance(v, torch.Tensor) else v
                     for v in (vals if isinstance(vals, (tuple, list)) else [vals])]
            facts.append((name, node.name, node.op, str(node.target), str(metas),
                          node.meta.get("stack_trace"), str(node.meta.get("nn_module_stack"))))
    return facts


@pytest.mark.parametrize("case", list(STAMP_CASES))
def test_stamped_lowering_matches_torchs_rule(case):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, args = STAMP_CASES[case]()
    programs = []
    for stamp_out in (True, False):  # one call site: node stack traces name it
        with stampout.config.patch(stamp_out_lowering=stamp_out):
            programs.append(stampout.export(model, *args))
    fast, reference = programs
    assert _graph_facts(fast) == _graph_facts(reference)
    assert fast.graph_signature == reference.graph_signature
    torch.testing.assert_close(fast.module()(*args), model(*args), rtol=0, atol=0)


def test_later_region_calls_are_stamped_out(monkeypatch):
    lowering = sys.modules["stampout.export.lowering"]
    stamped = []
    stamp_out = lowering._Lowering._stamp_out
    monkeypatch.setattr(lowering._Lowering, "_stamp_out", lambda self, *a: stamped.append(a[2]) or stamp_out(self, *a))
    ep = stampout.export(_divergent_llama(), ids())
    assert len(invokes(ep.graph_module)) == 4 and len(stamped) == 2  # layers 1 and 3; 0 and 2 are lowered by torch
    stamped.clear()
    net, x = _view_out_net(), torch.randn(2, 8)
    ep = stampout.export(net, x)
    # the region's view of its input is taken by the caller (as_strided of the operand), so the subgraph
    # returns nothing aliasing an input and later calls are stamped out too
    assert len(stamped) == 2
    torch.testing.assert_close(ep.module()(x), net(x))


def test_lowered_graphs_print_copy_and_pickle():
    model, x = llama(2), ids()
    ep = stampout.export(model, x)
    assert "invoke_subgraph" in ep.graph_module.code and "rsqrt" in ep.graph_module.repeated_subgraph0.code
    copied = copy.deepcopy(ep)
    torch.testing.assert_close(copied.module()(x), model(x), rtol=0, atol=0)
    region = ep.graph_module.repeated_subgraph0  # (torch cannot pickle a module that calls invoke_subgraph)
    assert "rsqrt" in pickle.loads(pickle.dumps(region)).code


def test_a_dim_on_an_input_only_handed_to_regions():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.mlp = nn.LayerNorm(16), nn.Linear(16, 16)

        @stampout.region
        def forward(self, x):
            return x + self.mlp(self.norm(x))

    model = nn.Sequential(*[Block() for _ in range(3)])
    ep = stampout.export(model, torch.randn(8, 16), dynamic_shapes=({0: Dim("b", min=2, max=32)},))
    assert len(invokes(ep.graph_module)) == 3
    y = torch.randn(5, 16)
    torch.testing.assert_close(ep.module()(y), model(y))
