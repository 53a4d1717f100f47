"""The zoo's decoders, mixtures of experts and state-space models (zoo_checks.py): capture and compile equal
eager."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
from zoo_checks import check_capture_and_compile, models  # noqa: E402

pytestmark = pytest.mark.zoo


@pytest.mark.parametrize("zoo", models("decoders"))
def test_zoo_capture_and_compile_match_eager(zoo):
    check_capture_and_compile(zoo)
