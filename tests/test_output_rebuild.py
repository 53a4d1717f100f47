"""A compiled call's outputs rebuilt by the generated function (compile/outputs.py): equal to eager's in type,
items and attributes, a fresh object each call (a caller's mutation of one never reaches the next), and a
ModelOutput subclass that changes what its constructor does still built by its constructor."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch import nn

import stampout
from stampout.compile.outputs import OutputBuilder

transformers = pytest.importorskip("transformers")
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402
from transformers.utils import ModelOutput  # noqa: E402


@dataclasses.dataclass
class Tagged(CausalLMOutputWithPast):
    """Its __post_init__ does more than ModelOutput's (an attribute of its own): no recorded shortcut may skip it."""

    def __post_init__(self):
        super().__post_init__()
        self.tag = ("rows", self.logits.shape[0])


class Step(nn.Module):
    def __init__(self, output: type = CausalLMOutputWithPast) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.output = output

    def forward(self, x: torch.Tensor, cache: object) -> ModelOutput:
        return self.output(logits=self.lin(x), cache=cache, hidden_states=(x + 1, x * 2))


@pytest.mark.parametrize("output", [CausalLMOutputWithPast, Tagged], ids=["model-output", "own-post-init"])
def test_outputs_equal_eager_each_call_and_fresh(output):
    model, cache = Step(output), transformers.DynamicCache()
    fn = stampout.compile(model, backend="eager")
    for i in range(4):
        x = torch.randn(2, 4)
        got, expected = fn(x, cache), model(x, cache)
        assert type(got) is type(expected) and list(got.keys()) == list(expected.keys())
        assert list(vars(got)) == list(vars(expected))
        if output is Tagged:
            assert got.tag == expected.tag == ("rows", 2)
        torch.testing.assert_close(got.logits, expected.logits)
        torch.testing.assert_close(got["logits"], expected["logits"])
        assert got.cache is cache and got["cache"] is cache and got.loss is None and got.attentions is None
        torch.testing.assert_close(got.hidden_states, expected.hidden_states)
        got["logits"] = torch.zeros(1)  # (the caller's own object: the next call's is another)
        got.extra = 1
    assert fn.stats.captures == 1
    later = fn(x, cache)
    assert later.logits.shape == (2, 4) and "extra" not in vars(later)
    (entry,) = fn._compiled._entries
    shortcut = "_model_output" in entry.outputs._fast.source_code
    assert shortcut is (output is CausalLMOutputWithPast)  # (Tagged: its constructor)


def test_a_template_of_containers_is_rebuilt_as_build_does():
    from stampout.trace.structure import build, to_template

    Pair = collections.namedtuple("Pair", "a b")
    value = {"t": (torch.ones(1), [torch.zeros(2), 3]), "p": Pair(torch.ones(3), "s"), "size": torch.Size([2, 3]),
             "od": collections.OrderedDict(k=torch.ones(1))}
    holes: list = []
    template = to_template(value, holes)
    builder = OutputBuilder(template)
    first = builder(holes, [])
    fresh = [h.clone() if isinstance(h, torch.Tensor) else h for h in holes]
    second = builder(fresh, [])
    assert builder._fast is not None
    for made in (first, second):
        expected = build(template, holes if made is first else fresh, [])
        assert type(made) is type(expected) and repr(made) == repr(expected)
    assert second["t"][0] is fresh[0] and type(second["p"]) is Pair and type(second["size"]) is torch.Size


@dataclasses.dataclass
class Doubled(CausalLMOutputWithPast):
    """Its __post_init__ changes a field: rebuilt by calling it again, the logits would be doubled twice."""

    def __post_init__(self):
        super().__post_init__()
        self.logits = self.logits * 2


@dataclasses.dataclass
class Scaled:
    y: torch.Tensor
    norm: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self):
        self.y = self.y * 2
        self.norm = self.y.abs().sum()


@dataclasses.dataclass(frozen=True)
class FrozenShifted:
    y: torch.Tensor

    def __post_init__(self):
        object.__setattr__(self, "y", self.y + 1)


@dataclasses.dataclass(slots=True)
class SlotsNegated:
    y: torch.Tensor

    def __post_init__(self):
        self.y = -self.y


def _made(output: type, y: torch.Tensor):
    return output(logits=y) if output is Doubled else output(y)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("output", [Doubled, Scaled, FrozenShifted, SlotsNegated])
def test_a_post_init_that_changes_a_field_runs_once_as_in_eager(output, backend):
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return _made(output, self.lin(x))

    model = Head()
    fn = stampout.compile(model, backend=backend)
    for _ in range(3):
        x = torch.randn(2, 4)
        got, expected = fn(x), model(x)
        assert type(got) is type(expected)
        for name in [f.name for f in dataclasses.fields(output)]:
            if getattr(expected, name, None) is not None:
                torch.testing.assert_close(getattr(got, name), getattr(expected, name))
        if output is Doubled:
            assert list(got.keys()) == list(expected.keys())
            torch.testing.assert_close(got["logits"], expected["logits"])
    assert fn.stats.captures == 1


def test_the_first_calls_outputs_are_freed_without_a_collection():
    """The first call derives the generated rebuild from what it built; nothing of that call (its outputs, their
    autograd graphs, which hold the parameters) may stay alive after the caller drops them (a reference cycle did:
    `torch.utils.swap_tensors` then refused the parameters until the next collection)."""
    import gc
    import weakref

    model = Step()
    fn = stampout.compile(model, backend="eager")
    gc.disable()
    try:
        out = fn(torch.randn(2, 4), None)
        logits = weakref.ref(out.logits)
        del out
        assert logits() is None
    finally:
        gc.enable()
