"""torch._check and friends are checks, not data: runtime asserts in the graph, never a CaptureError."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_matches_eager
from torch import nn

import stampout

ASSERT = torch.ops.aten._assert_async.msg
pytestmark = pytest.mark.filterwarnings("ignore:_check_is_size:FutureWarning")


def asserts(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (torch._assert_async, ASSERT)]


class Checked(nn.Module):
    """What transformers' `torch_compilable_check` does while tracing (LLaVA's image-token count check)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        torch._assert(x.isfinite().all(), "x must be finite")
        torch._check_tensor_all(x.abs().sum(-1) < 100, lambda: f"too large: {x.abs().sum()}")
        torch._check(x.shape[0] > 1)
        torch._check_is_size(x.shape[0])
        return self.lin(x)


def test_checks_capture_as_runtime_asserts():
    cap = assert_matches_eager(Checked(), torch.randn(3, 4), grad=True)
    assert len(asserts(cap.gm)) == 2


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_failing_check_raises_at_run_time(backend):
    model = Checked()
    fn = stampout.compile(model, backend=backend)
    x = torch.randn(3, 4)
    torch.testing.assert_close(fn(x), model(x))
    with pytest.raises(RuntimeError, match="too large"):
        model(torch.full((3, 4), 50.0))  # eager raises ...
    with pytest.raises(RuntimeError, match="Expected cond to be True"):
        fn(torch.full((3, 4), 50.0))  # ... and so does the compiled graph, with the same guards (no recapture)
    with pytest.raises(RuntimeError, match="x must be finite"):
        fn(torch.full((3, 4), float("nan")))
    assert fn.stats.captures == 1


def test_message_from_tensor_values_is_not_traced():
    cap = stampout.capture(Checked(), torch.randn(3, 4))
    assert "too large" not in cap.gm.code  # the message needs values the capture does not have
    assert len([n for n in cap.gm.graph.nodes if n.op == "call_method" and n.target == "abs"]) == 1


def test_check_with_dynamic_sizes():
    model = Checked()
    fn = stampout.compile(model, backend="aot_eager", dynamic=True)
    for n in (3, 5):
        x = torch.randn(n, 4)
        torch.testing.assert_close(fn(x), model(x))
    assert fn.stats.captures == 1


def test_llava_compiles_at_two_lengths():
    """transformers' LLaVA checks its image-token count with torch._check_tensor_all while tracing."""
    pytest.importorskip("transformers")
    from zoo_models import llava, llava_inputs

    model = llava()
    fn = stampout.compile(model, backend="aot_eager")
    with torch.no_grad():
        for extra in (0, 3):
            kwargs = llava_inputs(extra)
            torch.testing.assert_close(fn(**kwargs).logits, model(**kwargs).logits)
    assert fn.breaks == [] and fn.stats.captures == 2
