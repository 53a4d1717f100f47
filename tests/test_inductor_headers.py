"""Inductor's C++ header precompile, inside stampout's compiles, only where it pays (backends/startup.py).

One fresh process with its own Inductor cache and temporary directory (where Inductor keeps precompiled headers),
so the kernels and the header are really built: a training compile of two kernel modules builds them without the
header; with the bar lowered, a compile's kernels wait for the header, precompiled once on a background thread,
and the store remembers it for a later process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_CHILD = """
import json, threading, torch, stampout
from stampout.backends import startup


def region_fn(x, w):
    return torch.relu(x * w).sin()

def model(x, w):
    return stampout.region(region_fn)(x, w) * 2

def run(fn, *shape):
    x = torch.randn(*shape, requires_grad=True)
    w = torch.randn(shape[-1], requires_grad=True)
    out = stampout.compile(fn, backend="inductor")(x, w)
    out.sum().backward()
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    fn(x2, w2).sum().backward()
    torch.testing.assert_close(out, fn(x2, w2))
    torch.testing.assert_close((x.grad, w.grad), (x2.grad, w2.grad))

run(model, 3, 5)
small = dict(startup.STATS)
startup.PAYS_FROM_KERNELS = startup.PAYS_FROM_OTHERS = 1
run(lambda x, w: model(x, w).cos(), 4, 6)
for thread in threading.enumerate():
    if thread.name == "stampout-header":
        thread.join()
remembered = [startup._precompiled_before(h, c) for h, c in startup._chosen]
print(json.dumps({"small": small, "paid": startup.STATS, "remembered": remembered}))
"""


@pytest.mark.inductor
def test_the_header_is_precompiled_in_the_background_only_where_it_pays(tmp_path):
    """Two kernel modules (a tiny region's forward and backward, their kernels one library): built without the
    precompiled header, none started. With the bar at one module: one precompile, on the background thread, and the store names its
    `.gch`; outputs and gradients are eager's both times."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TMPDIR": str(tmp),
           "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    small, paid = got["small"], got["paid"]
    assert small["headers_deferred"] >= 1 and small["headers_background"] == 0, small  # (one library: kernel_batch)
    assert small["headers_precompiled"] == 0 and small["headers_built"] == 0, small
    assert paid["headers_background"] == 1 and paid["headers_precompiled"] == 0, paid
    assert got["remembered"] and all(got["remembered"]), got
