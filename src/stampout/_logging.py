"""`STAMPOUT_LOGS`: like TORCH_LOGS. A comma list of `regions`, `guards`, `capture`, `backends`, `timing`, `breaks`
(where compile runs code eagerly, and why), `all`; `+name` for debug. An unknown name is refused (as TORCH_LOGS
does), with the valid ones."""

from __future__ import annotations

import logging

from . import config
from .errors import StampoutError, message

NAMES = ("regions", "guards", "capture", "backends", "timing", "breaks")


def configure(spec: str | None = None) -> None:
    spec = config.logs if spec is None else spec
    items = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [item for item in items if item.lstrip("+-") not in (*NAMES, "all")]
    if unknown:
        raise StampoutError(message(
            f"STAMPOUT_LOGS={spec!r}: unknown name{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}",
            "the STAMPOUT_LOGS environment variable",
            f"use a comma list of {', '.join((*NAMES, 'all'))}; +name for debug output (STAMPOUT_LOGS=+regions)",
        ))
    root = logging.getLogger("stampout")
    for item in items:
        level = logging.DEBUG if item.startswith("+") else logging.INFO
        name = item.lstrip("+-")
        targets = NAMES if name == "all" else (name,)
        for target in targets:
            logging.getLogger(f"stampout.{target}").setLevel(level)
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
            root.addHandler(handler)
