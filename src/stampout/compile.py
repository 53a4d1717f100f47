"""stampout.compile: placeholder module owning compiled-function caches (see issue 4)."""

from __future__ import annotations

import weakref

_LIVE: "weakref.WeakSet" = weakref.WeakSet()


def reset_all() -> None:
    for fn in list(_LIVE):
        fn.reset()
