"""The zoo's diffusers models (zoo_checks.py): capture and compile equal eager; every family of the zoo is
checked by one of the test_hf_zoo_*.py files."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
from zoo_checks import FILES, SYMBOLIC_AS, check_capture_and_compile, models  # noqa: E402
from zoo_models import ZOO, Family  # noqa: E402

pytestmark = pytest.mark.zoo


@pytest.mark.parametrize("zoo", models("diffusers"))
def test_zoo_capture_and_compile_match_eager(zoo):
    check_capture_and_compile(zoo)


def test_every_zoo_family_is_checked_by_one_file():
    grouped = [family for families in FILES.values() for family in families]
    assert sorted(grouped, key=str) == sorted(set(grouped), key=str)
    assert set(grouped) == set(Family) and {z.family for z in ZOO} <= set(grouped)


def test_every_model_compiled_at_one_size_names_one_compiled_at_two():
    names = {z.name for z in ZOO}
    assert set(SYMBOLIC_AS) <= names and set(SYMBOLIC_AS.values()) <= names - set(SYMBOLIC_AS)
