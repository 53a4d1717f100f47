"""How many examples each hypothesis fuzzer draws: the number written at the test, times `STAMPOUT_FUZZ_SCALE`
(default 1, what `make test` runs; e.g. `STAMPOUT_FUZZ_SCALE=10 pytest tests/test_fuzz_*.py` for a long run).

    @settings(max_examples=examples(40), deadline=None, derandomize=True)
"""

from __future__ import annotations

import os

SCALE = float(os.environ.get("STAMPOUT_FUZZ_SCALE", "1"))


def examples(n: int) -> int:
    """``n`` scaled by ``STAMPOUT_FUZZ_SCALE``, at least one."""
    return max(1, round(n * SCALE))
