"""A restart compiles nothing: a second process on the same TORCHINDUCTOR_CACHE_DIR finds the region's (or the whole
graph's) forward and backward in AOTAutogradCache and the FX graph cache, and Inductor's ISA verdicts in stampout's
store. (Its own file: two cold and two warm Inductor processes, so xdist can run it beside test_backends.py.)"""

from __future__ import annotations

import pytest

_RESTART = """
import json, sys, torch, stampout
from stampout.backends import toolchain
from stampout.tools.models import LlamaConfig, LlamaLike
from torch._dynamo.utils import counters
stampout.config.glue = sys.argv[1]
fn = stampout.compile(LlamaLike(LlamaConfig(layers=2), regions=True), backend="inductor")
fn(torch.randint(0, 128, (2, 8))).float().pow(2).mean().backward()
print(json.dumps({**{k: v for g in ("aot_autograd", "inductor") for k, v in counters[g].items() if "cache" in k},
                  "isa": toolchain.STATS}))
"""


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize("glue", ["auto", "whole"], ids=["regions_apart", "whole_graph"])
def test_a_restart_finds_everything_in_the_caches(tmp_path, glue):
    """A second process on the same TORCHINDUCTOR_CACHE_DIR compiles nothing: the region's (or, whole, the
    graph's with invoke_subgraph and allow_buffer_reuse=False) forward and backward come from AOTAutogradCache
    and the FX graph cache, and Inductor's ISA check from stampout's store."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _RESTART, glue], env=env, capture_output=True, text=True,
                              check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold.get("autograd_cache_miss") == 1 and cold.get("fxgraph_cache_miss") == 2, cold
    assert not cold.get("autograd_cache_bypass") and not cold.get("fxgraph_cache_bypass"), cold
    assert sum(cold["isa"].values()) >= 1, cold  # Inductor's own instances were checked, not answered by the plan
    assert warm.get("autograd_cache_hit") == 1 and warm.get("fxgraph_cache_hit") == 2, warm
    assert not warm.get("autograd_cache_miss") and not warm.get("fxgraph_cache_miss"), warm
    assert not warm.get("autograd_cache_bypass") and not warm.get("fxgraph_cache_bypass"), warm
    assert warm["isa"]["run"] == 0 and warm["isa"]["waited"] == 0 and warm["isa"]["remembered"] >= 1, warm
