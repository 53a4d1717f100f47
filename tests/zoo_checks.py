"""The zoo's checks: architectures of transformers 5 and diffusers nobody here wrote (tiny configs, random weights,
built in tests/zoo_models.py). Each: `stampout.capture` equals eager with its repeated layers as regions (exact
region trace and reuse counts); `stampout.compile(aot_eager, regions="auto")` equals eager at two sizes (the second
captured with symbolic sizes; at the first only where `SYMBOLIC_AS` names the model whose code it runs at the second),
with no graph break except where the issue allows one. Some decoders also train
(gradients against eager) and generate (tokens and logits against eager).

The tests are in test_hf_zoo_*.py, one file per group of `FILES` (xdist runs a file on one worker: the groups
let the zoo's minutes spread over the workers). Skip locally with `-m "not zoo"`."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from generation_models import assert_same_generation, greedy
from helpers import assert_matches_eager, named_grads, scalar_loss, tree_assert_close
from zoo_models import ZOO, Family, ZooModel

import stampout

TOL = dict(rtol=1e-4, atol=1e-5)


@dataclasses.dataclass(frozen=True)
class Regions:
    """Region calls of one capture with regions="auto": traced (one per distinct layer kind) and reused."""

    traces: int
    reuses: int


ONE_KIND = Regions(1, 2)  # three identical layers: one trace, two reuses
# Architectures whose layers are not all of one kind (static capture), and why.
REGIONS: dict[str, Regions] = {
    "gemma2": Regions(1, 1),  # sliding and full layers alternate: the full one is traced, then deduped
    "gemma3": Regions(1, 1),
    "jamba": Regions(2, 2),  # mamba and attention layers, two of each
    "albert": Regions(0, 0),  # one layer called three times: nothing repeats in a ModuleList
    "t5": Regions(4, 2),  # per stack: the first block owns the relative attention bias
    "bart": Regions(2, 4),  # encoder and decoder layers
    "whisper": Regions(2, 4),
    "vit": ONE_KIND,
    "swin": Regions(6, 0),  # two stages of a window block and a shifted-window block, at two widths
    "convnext": Regions(4, 2),  # two stages (two widths), two layers each
    "resnet": Regions(10, 2),  # stages, their layers (the first with a downsampling shortcut), conv layers
    "clip": Regions(2, 4),  # text and vision towers
    "siglip": Regions(2, 4),
    "llava": Regions(2, 1),  # vision tower (traced, then deduped) and language model layers
    "flux": Regions(3, 1),  # double-stream blocks; single-stream blocks (the first takes a concatenated view)
    "sd3": Regions(2, 0),  # the last joint block is context-pre-only
    "wan": Regions(1, 1),
    "pixart": Regions(2, 0),  # the first block's input is a transposed view of the patch embedding (strides)
    "sana": Regions(2, 0),
    "unet": Regions(9, 8),
    "vae": Regions(9, 3),
}
# Where the symbolic capture (the second size) stamps out otherwise than the static one.
SYMBOLIC_REGIONS: dict[str, Regions] = {
    "whisper": Regions(1, 5),  # the encoder's input keeps its size: its layers reuse the static trace
    "convnext": Regions(5, 1),
    "unet": Regions(11, 5),
    "llava": Regions(1, 3),
}
# Architectures compiled at their first size only: at a symbolic size they run the named zoo model's code (the same
# embeddings, masks, rotary or position code and attention), which is compiled at both sizes; what differs is
# shape-agnostic (biases, norms, a clamp, a projection). Their exact capture and static compile are checked as all.
SYMBOLIC_AS: dict[str, str] = {"mistral": "llama", "qwen2": "llama", "olmo": "llama", "electra": "bert"}
# Where a part of the model runs eagerly, and why (the issue allows these).
BREAKS: dict[str, list[str]] = {
    # `grid_thw.tolist()` in the vision position ids; each vision attention splits by `cu_seqlens.tolist()`
    "qwen2_vl": ["model.visual", "model.visual.blocks.0.attn", "model.visual.blocks.1.attn"],
}


def _regions(cap) -> Regions:
    return Regions(cap.stats.traces, cap.stats.reuses)


def check_capture_and_compile(zoo: ZooModel) -> None:
    torch.manual_seed(0)
    model = zoo.build().eval()
    reference = copy.deepcopy(model)
    small, large = (zoo.inputs(size) for size in zoo.sizes)
    with torch.no_grad():
        if zoo.name in BREAKS:
            with pytest.raises(stampout.CaptureError, match=r"tensor.item\(\)"):
                stampout.capture(model, **small)
        else:
            with stampout.auto_regions(model):
                cap = assert_matches_eager(model, **small, **TOL)
            assert _regions(cap) == REGIONS.get(zoo.name, ONE_KIND)
            assert cap.stats.subgraphs == cap.stats.traces

        fn = stampout.compile(model, backend="aot_eager", regions="auto")
        static_only = zoo.name in SYMBOLIC_AS
        for kwargs in (small,) if static_only else (small, large):
            tree_assert_close(fn(**kwargs), reference(**kwargs), **TOL)
        symbolic = fn.last_capture
        tree_assert_close(fn(**small), reference(**small), **TOL)
    if zoo.name in BREAKS:
        assert [b.module for b in fn.breaks] == BREAKS[zoo.name]
        assert all("tensor.item()" in b.reason for b in fn.breaks)
        return
    assert fn.breaks == []
    if static_only:
        assert fn.stats.captures == 1 and _regions(symbolic) == REGIONS.get(zoo.name, ONE_KIND)
        return
    assert fn.stats.captures == 2  # static at the first size, symbolic from the second on
    assert _regions(symbolic) == SYMBOLIC_REGIONS.get(zoo.name, REGIONS.get(zoo.name, ONE_KIND))


# Which file checks which families (capture and compile); training and generation are test_hf_zoo_training.py's.
FILES: dict[str, tuple[Family, ...]] = {
    "decoders": (Family.DECODER, Family.MOE, Family.STATE_SPACE),
    "encoders": (Family.ENCODER, Family.ENCODER_DECODER, Family.VISION, Family.MULTIMODAL),
    "diffusers": (Family.DIFFUSERS,),
}


def models(group: str) -> list:
    """The zoo models of one file's group, as pytest params named by architecture."""
    return [pytest.param(z, id=z.name) for z in ZOO if z.family in FILES[group]]


def _zoo(name: str) -> ZooModel:
    return next(z for z in ZOO if z.name == name)


TRAINED = ["llama", "bloom", "mixtral", "resnet"]  # rotary, ALiBi, MoE; BatchNorm updating its stats in regions


def check_trains(name: str) -> None:
    """Training mode (decoders: HF's own loss from labels): the captured program's gradients, then the compiled
    one's at two sizes, against eager's; buffers (BatchNorm's running stats) as eager leaves them."""
    zoo = _zoo(name)
    torch.manual_seed(0)
    model = zoo.build().train()

    def batch(size: int) -> dict:
        kwargs = zoo.inputs(size)
        return dict(kwargs, labels=kwargs["input_ids"]) if zoo.family in (Family.DECODER, Family.MOE) else kwargs

    with stampout.auto_regions(model):
        cap = assert_matches_eager(model, **batch(zoo.sizes[0]), grad=True, **TOL)
    assert _regions(cap) == REGIONS.get(name, ONE_KIND)
    model.zero_grad()
    reference = copy.deepcopy(model)  # (the captured call updated the model's running stats)
    fn = stampout.compile(model, backend="aot_eager", regions="auto")
    for size in zoo.sizes:
        out, expected = fn(**batch(size)), reference(**batch(size))
        tree_assert_close(out, expected, **TOL)
        scalar_loss(out).backward()
        scalar_loss(expected).backward()
        tree_assert_close(named_grads(model), named_grads(reference), check_requires_grad=False, **TOL)
        tree_assert_close(dict(model.named_buffers()), dict(reference.named_buffers()), **TOL)
        model.zero_grad()
        reference.zero_grad()
    assert fn.breaks == [] and fn.stats.captures == 2


GENERATED = ["phi3", "bloom", "falcon"]  # test_generation.py has seven others


def check_generates(name: str) -> None:
    """`model.forward = stampout.compile(model.forward)` (HF's recipe), greedy `generate` with a dynamic cache:
    the same tokens and per-step logits as eager; prefill, the first decode step, then one symbolic capture."""
    torch.manual_seed(0)
    model = _zoo(name).build().eval()
    model.generation_config.disable_compile = True  # HF must not compile on its own
    expected = greedy(model, "dynamic")
    model.forward = stampout.compile(model.forward, backend="aot_eager", regions="auto")
    assert_same_generation(greedy(model, "dynamic"), expected)
    assert_same_generation(greedy(model, "dynamic"), expected)
    assert model.forward.breaks == [] and model.forward.stats.captures == 3
