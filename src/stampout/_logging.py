"""`STAMPOUT_LOGS`: like TORCH_LOGS. A comma list of `regions`, `guards`, `capture`, `backends`, `timing`, `breaks`
(where compile runs code eagerly, and why), `all`;
`+name` for debug."""

from __future__ import annotations

import logging
import os

_NAMES = ("regions", "guards", "capture", "backends", "timing", "breaks")


def configure(spec: str | None = None) -> None:
    spec = os.environ.get("STAMPOUT_LOGS", "") if spec is None else spec
    root = logging.getLogger("stampout")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        level = logging.DEBUG if item.startswith("+") else logging.INFO
        name = item.lstrip("+-")
        targets = _NAMES if name == "all" else (name,)
        for target in targets:
            logging.getLogger(f"stampout.{target}").setLevel(level)
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
            root.addHandler(handler)
