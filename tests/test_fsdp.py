"""FSDP2 (`fully_shard`) on 2 gloo ranks: compile trains as eager, one region trace for the sharded blocks.

The scenarios run in tests/distributed_worker.py, all of this file's in one pair of rank processes on 127.0.0.1
(tests/distributed_ranks.py: the module's `ranks` fixture), with timeouts, so a hung collective fails the tests
instead of hanging them.
"""

from __future__ import annotations

import pytest
import torch
from distributed_ranks import on_ranks, ranks_fixture, skip_without_gloo

import stampout
from stampout.guards.guard import describe_hooks, hooks_key

needs_gloo = skip_without_gloo()
ranks = ranks_fixture("distributed_worker")
FSDP = "fsdp_compile:eager,aot_eager"
TWINS = "fsdp_twins"
HF = "hf_llama:aot_eager"
HF_RECIPE = "hf_llama:aot_eager:forward"
INDUCTOR = "fsdp_inductor"
TP = "tp:eager,aot_eager"
TP_MIXED = "tp:eager:auto:mixed"


@needs_gloo
@on_ranks(FSDP)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fsdp_compile_trains_as_eager(ranks, backend):
    for report in ranks(FSDP):
        rows = report[backend]["rows"]
        assert len(rows) == 3
        for row in rows:  # loss and every sharded parameter's full gradient, step after step, vs eager
            assert row["params"] == 39 and row["missing"] == []
            assert row["loss"] <= 1e-6 and row["grad"] <= 1e-6, rows


@needs_gloo
@on_ranks(FSDP)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fsdp_world_after_training(ranks, backend):
    for report in ranks(FSDP):  # the optimizer stepped on eager's sharded gradients; FSDP's state is as eager's
        world = report[backend]["world"]
        assert world == {"param": world["param"], "sharded": True, "forwards": []}
        assert world["param"] <= 1e-6


@needs_gloo
@on_ranks(FSDP)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fsdp_compile_warns_of_nothing(ranks, backend):
    """The root of a sharded stack runs its own code eagerly around its compiled children by design (sharded.py):
    that is logged at INFO, not as a warning that it 'runs eagerly' and 'cannot keep its gradients' on every rank."""
    for report in ranks(FSDP):
        assert report[backend]["warnings"] == []


@needs_gloo
@on_ranks(FSDP)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fsdp_sharded_blocks_are_one_region_trace(ranks, backend):
    for report in ranks(FSDP):
        stats = report[backend]["stats"]
        assert (stats["traces"], stats["reuses"]) == (1, 3)
        # block 0 alone is captured, once over 3 steps: the root's own code runs eagerly, and so do its unsharded
        # leaf children (embed, norm, head: piecewise.py's Note); blocks 1-3 take block 0's entry (sharded_twins.py)
        assert (stats["captures"], stats["recaptures"]) == (1, 1)
        assert len(stats["breaks"]) == 1 and "layers.0 is sharded with fully_shard" in stats["breaks"][0]
        if backend == "aot_eager":  # the 4 blocks' graphs are one AOTAutograd compile
            assert stats["region_compiles"] == 1


@needs_gloo
@on_ranks(FSDP)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fsdp_steady_step_checks_per_call_only(ranks, backend):
    """After the first steps, FSDP's parameter swaps (2 per parameter and step, and again in backward) move no
    write epoch, so no piece runs its full guard check: each checks its swapped parameters by identity per call."""
    for report in ranks(FSDP):
        assert report[backend]["steady"] == {"epoch_moved": False, "full_checks": 0}


@needs_gloo
@on_ranks(FSDP)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fsdp_ranks_capture_the_same_program(ranks, backend):
    first, second = (r[backend]["stats"] for r in ranks(FSDP))
    assert first["code"] == second["code"] and "invoke_subgraph" in first["code"]
    assert first == second


@needs_gloo
@on_ranks(FSDP)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fsdp_compiled_root_reports_its_pieces(ranks, backend):
    """What a user sees of the compiled root without walking its pieces (its own code runs eagerly): its stats
    count the pieces' captures (block 0: embed, norm and head run eagerly in the root's code), the blocks' one
    trace and 3 reuses; last_capture is the graph that ran last (block 3's: block 0's entry), explain lists the 4
    pieces (the blocks); the same on both ranks."""
    first, second = (r[backend]["stats"]["public"] for r in ranks(FSDP))
    assert first["stats"] == [1, 1, 3]
    assert "invoke_subgraph" in first["last_code"] and "embedding" not in first["last_code"]
    assert first["explain_pieces"] == 4 and first["guard_code"]
    assert first["glue"] == ["embed, norm, head"]  # (explain names what runs eagerly in the root's code)
    assert first == second


@needs_gloo
@on_ranks(TWINS)
def test_fsdp_blocks_take_a_siblings_entry_when_its_guards_pass(ranks):
    """Sharded blocks 1 and 3 run block 0's compiled entry (no capture of their own); block 2 reads another eps,
    fails that entry's guards and is captured (a second region trace); gradients as eager's throughout."""
    reports = ranks(TWINS)
    for report in reports:
        for row in report["rows"]:
            assert row["params"] == 39 and row["missing"] == [] and row["loss"] <= 1e-6 and row["grad"] <= 1e-6
        stats = report["stats"]
        assert (stats["traces"], stats["reuses"], stats["captures"]) == (2, 2, 2), stats
        assert report["shared"] == [True, True, False, True]
    assert reports[0]["stats"] == reports[1]["stats"]


@needs_gloo
@on_ranks(TWINS)
@pytest.mark.xfail(strict=True, reason="since classes and functions reached as values are guarded with what they "
                   "define (session 35), a sibling block's guards differ from block 0's in some guard: each block "
                   "generates its own guard predicates (right, costs a guard compile per block)")
def test_fsdp_sibling_blocks_share_block_zeros_guard_predicates(ranks):
    """Blocks 1 and 3 also run block 0's generated guard predicates: the same guards, one function each."""
    for report in ranks(TWINS):
        assert report["predicates"] == [True, True, False, True]


@needs_gloo
@on_ranks(FSDP)
def test_fsdp_capture_trains_as_eager(ranks):
    """stampout.capture of the sharded model, called for 3 SGD steps: eager's loss and full gradients, bitwise; the
    optimizer's steps on the sharded gradients leave the parameters as eager's."""
    for report in ranks(FSDP):
        rows = report["capture"]["rows"]
        assert len(rows) == 3
        for row in rows:
            assert row["params"] == 39 and row["missing"] == []
            assert row["loss"] <= 1e-6 and row["grad"] <= 1e-6, rows
        world = report["capture"]["world"]
        assert world["sharded"] and world["forwards"] == [] and world["param"] <= 1e-6


@needs_gloo
@on_ranks(FSDP)
def test_fsdp_capture_is_one_graph_with_boundaries(ranks):
    """One graph: each sharded module's hooks are two nodes around its forward, the 4 blocks one region trace;
    the unsharded parameters are outputs of the pre-forward node, not placeholders; both ranks captured it."""
    first, second = (r["capture"]["stats"] for r in ranks(FSDP))
    assert (first["traces"], first["reuses"], first["subgraphs"]) == (1, 3, 1)
    assert first["placeholders"] == ["ids"] and first["lint"]
    code = first["code"]
    assert code.count("fsdp_pre_forward(") == code.count("fsdp_post_forward(") == 5  # the root and 4 blocks
    assert code.count("invoke_subgraph(") == 4 and "layers_3_attn_q_weight = fsdp_pre_forward" in code
    assert first == second


class _Scale:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def hook(self, module, args):
        return (args[0] * self.factor,)


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    @stampout.region
    def forward(self, x):
        return self.lin(x)


def test_hook_guard_names_what_differs():
    """Hooks bound to different objects are traced apart (a traced hook's state is not guarded), and the miss
    reason shows the two hooks' owners, not two equal counts."""
    torch.manual_seed(0)
    outer = torch.nn.ModuleList([_Layer(), _Layer()])
    a, b = _Scale(2.0), _Scale(3.0)
    outer[0].lin.register_forward_pre_hook(a.hook)
    outer[1].lin.register_forward_pre_hook(b.hook)

    def program(x):
        return outer[1](outer[0](x))

    x = torch.randn(2, 4)
    cap = stampout.capture(program, x)
    torch.testing.assert_close(cap(x), program(x))
    assert cap.stats.traces == 2 and cap.stats.reuses == 0
    reason = cap.events[1].reason
    assert f"<_Scale object at {id(a):#x}>" in reason and f"<_Scale object at {id(b):#x}>" in reason, reason
    assert describe_hooks(hooks_key(outer[0].lin)).startswith("hooks pre [_Scale.hook of <_Scale object")


@needs_gloo
@on_ranks(HF)
def test_fsdp_hf_llama_per_decoder_layer(ranks):
    pytest.importorskip("transformers")
    reports = ranks(HF)
    for report in reports:
        for row in report["rows"]:
            assert row["params"] == 21 and row["missing"] == [] and row["loss"] <= 1e-6 and row["grad"] <= 1e-6
        assert report["world"]["sharded"] and report["world"]["param"] <= 1e-6
        stats = report["stats"]
        assert (stats["traces"], stats["reuses"]) == (1, 1)
        # decoder layer 0 alone (layer 1 takes its entry): embed, rotary, norm and head run eagerly (piecewise.py)
        assert stats["captures"] == stats["recaptures"] == 1
        assert stats["public"]["stats"] == [1, 1, 1] and stats["public"]["last_code"] is not None
        assert stats["public"]["glue"] == ["lm_head", "model.embed_tokens, model.norm, model.rotary_emb"]
        assert report["warnings"] == []
    assert reports[0]["stats"] == reports[1]["stats"]


@needs_gloo
@on_ranks(HF_RECIPE)
def test_fsdp_hf_llama_compiled_forward_runs_piecewise(ranks):
    """The Hugging Face recipe on the sharded Llama (`model.forward = stampout.compile(model.forward)`): the root's
    forward runs eagerly around its compiled children, as when the model is compiled (it ran wholly eagerly)."""
    pytest.importorskip("transformers")
    reports = ranks(HF_RECIPE)
    for report in reports:
        for row in report["rows"]:
            assert row["params"] == 21 and row["missing"] == [] and row["loss"] <= 1e-6 and row["grad"] <= 1e-6
        stats = report["stats"]
        assert (stats["traces"], stats["reuses"], stats["captures"]) == (1, 1, 1), stats
        # (pieces: model, model.layers.0 and .1; embed, rotary, norm and lm_head run eagerly in their parents' code)
        assert stats["public"]["stats"] == [1, 1, 1] and stats["public"]["explain_pieces"] == 3
        assert stats["public"]["glue"] == ["lm_head", "model.embed_tokens, model.norm, model.rotary_emb"]
        assert report["warnings"] == []  # (the root and LlamaModel run their own code eagerly by design)
    assert reports[0]["stats"] == reports[1]["stats"]


@needs_gloo
@pytest.mark.inductor
@on_ranks(INDUCTOR)
def test_fsdp_inductor_tiny_stack(ranks):
    """Two sharded blocks through Inductor: one region compiled, eager's gradients. (The first block's input
    does not require grad, the second's does: with torch 2.13's C++ wrapper in training the first block's
    gradients were 13 % off — see backends/inductor.py.)"""
    reports = ranks(INDUCTOR)
    for report in reports:
        for row in report["rows"]:
            assert row["params"] == 18 and row["missing"] == []
            assert row["loss"] <= 1e-5 and row["grad"] <= 1e-5, report["rows"]
        assert report["world"]["sharded"] and report["world"]["param"] <= 1e-5
        assert (report["stats"]["traces"], report["stats"]["reuses"]) == (1, 1)
    assert reports[0]["stats"] == reports[1]["stats"]


@needs_gloo
@on_ranks(TP)
def test_tensor_parallel_regions_reused(ranks):
    """DTensor parameters (parallelize_module: gate/up column-wise, down row-wise) in regions marked by
    regions="auto": tensor parallelism's per-module hooks compare by value, so the 4 blocks are one trace;
    aot_eager compiles them (region calls with DTensor operands inlined), with eager's gradients."""
    reports = ranks(TP)
    for report in reports:
        for backend in ("eager", "aot_eager"):
            for row in report[backend]["rows"]:
                assert row["params"] == 16 and row["missing"] == [] and row["loss"] <= 1e-6 and row["grad"] <= 1e-6
            stats = report[backend]["stats"]
            assert (stats["traces"], stats["reuses"], stats["recaptures"]) == (1, 3, 1), stats
    assert reports[0]["eager"]["stats"] == reports[1]["eager"]["stats"]
    assert reports[0]["aot_eager"]["stats"] == reports[1]["aot_eager"]["stats"]


@needs_gloo
@on_ranks(TP_MIXED)
def test_tensor_parallel_hooks_with_other_values_trace_again(ranks):
    """Tensor parallelism's hooks compare by value: blocks whose style differs in a field are traced apart."""
    reports = ranks(TP_MIXED)
    for report in reports:
        for row in report["eager"]["rows"]:
            assert row["missing"] == [] and row["loss"] <= 1e-6 and row["grad"] <= 1e-6
        stats = report["eager"]["stats"]
        assert (stats["traces"], stats["reuses"]) == (2, 2), stats
        assert "compared by value" in stats["misses"][0]


def test_inline_regions_computes_what_the_region_graph_does():
    from stampout.backends.inline import inline_regions
    from stampout.torch_internals import INVOKE_SUBGRAPH

    torch.manual_seed(0)
    layers = torch.nn.ModuleList([_Layer(), _Layer(), _Layer()])

    def program(x):
        for layer in layers:
            x = layer(x)
        return x

    x = torch.randn(2, 4)
    cap = stampout.capture(program, x)
    flat = inline_regions(cap.gm)
    flat.graph.lint()
    assert not [n for n in flat.graph.nodes if n.target is INVOKE_SUBGRAPH]
    inputs = cap.placeholders_for((x,), {})
    torch.testing.assert_close(flat(*inputs)[0], program(x))
