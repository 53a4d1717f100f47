"""A small persistent store beside Inductor's own caches: facts worth keeping between processes.

It lives in `<Inductor cache dir>/stampout/` (`TORCHINDUCTOR_CACHE_DIR`, or Inductor's default), so a fresh
cache directory starts empty, like Inductor's FX graph and AOTAutograd caches, and clearing Inductor's
cache clears it too. Each namespace is one JSON file of string keys; writes are atomic (a temporary file
renamed over the old one) and merge with what another process wrote meanwhile. Keys should spell out
everything the value depends on (torch version, compiler, CPU flags): the store does not guess.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from typing import Any

log = logging.getLogger("stampout.backends")

_LOCK = threading.Lock()


def directory() -> str:
    from ..torch_internals import cache_dir

    return os.path.join(cache_dir(), "stampout")


def _path(namespace: str) -> str:
    return os.path.join(directory(), f"{namespace}.json")


def load(namespace: str) -> dict[str, Any]:
    """Everything stored under `namespace` ({} when nothing is, or the file is unreadable)."""
    try:
        with open(_path(namespace)) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        log.warning("stampout store %s unreadable (%s); starting it afresh", _path(namespace), error)
        return {}
    return data if isinstance(data, dict) else {}


def update(namespace: str, entries: dict[str, Any]) -> None:
    """Add `entries` to `namespace`, keeping what is already there (this process's or another's)."""
    if not entries:
        return
    path = _path(namespace)
    with _LOCK:
        merged = {**load(namespace), **entries}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{namespace}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(merged, f, sort_keys=True)
        os.replace(tmp, path)
