"""api.py is the one home of every public entry point, and `import stampout` still loads none of them."""

from __future__ import annotations

import subprocess
import sys

import stampout


def test_every_entry_point_is_defined_in_api():
    for name in ("capture", "compile", "explain", "export", "reset"):
        assert getattr(stampout, name).__module__ == "stampout.api", name


def test_importing_stampout_imports_no_torch():
    code = "import sys, stampout; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
