"""One identifier helper (names.identifier) for placeholder names and exported input names."""

from __future__ import annotations

import torch

import stampout


class _Named(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("b", torch.ones(3))

    def forward(self, batch, pair):
        return self.lin(batch["input-ids"]) + pair[1] + self.b


def test_exported_inputs_are_named_as_torch_export_names_them():
    # export kept its own sanitiser (each odd character to "_": `batch__input_ids`), the capture another
    # (runs of them to one "_"), and torch.export names this input `batch_input_ids`: one helper, names.identifier.
    model, args = _Named(), ({"input-ids": torch.randn(2, 3)}, (torch.randn(3), torch.randn(3)))
    ours = [spec.arg.name for spec in stampout.export(model, *args).graph_signature.input_specs]
    theirs = [spec.arg.name for spec in torch.export.export(model, args).graph_signature.input_specs]
    assert ours == theirs


def test_identifier():
    from stampout.trace.names import identifier

    assert identifier("layers.0.weight") == "layers_0_weight"
    assert identifier("batch['input-ids']") == "batch_input_ids"
    assert identifier("0.weight") == "_0_weight"
    assert identifier("[]") == "input" and identifier("[]", fallback="arg") == "arg"
