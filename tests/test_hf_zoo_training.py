"""The zoo in training and generation (zoo_checks.py): decoders and a ResNet train as eager (gradients, buffers);
decoders generate the tokens and logits of eager."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
from zoo_checks import GENERATED, TRAINED, check_generates, check_trains  # noqa: E402

pytestmark = pytest.mark.zoo


@pytest.mark.parametrize("name", TRAINED)
def test_zoo_trains_as_eager(name: str):
    check_trains(name)


@pytest.mark.parametrize("name", GENERATED)
def test_zoo_decoder_generates_as_eager(name: str):
    check_generates(name)
