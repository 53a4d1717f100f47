"""torch.compile's `mode=` and `options=`: Inductor config patches applied around the inductor backend.

The modes are torch.compile's (`torch._inductor.list_mode_options`), spelled out here so that a release that
renames one fails in a test rather than silently compiling something else. CUDA graphs (`triton.cudagraphs`)
only act on CUDA tensors; on CPU those modes compile as the rest of their options say.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable
from typing import Any

from ..errors import BackendError, message
from ..trace.frames import user_location
from . import background

log = logging.getLogger("stampout.backends")

MODE_OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "reduce-overhead": {"triton.cudagraphs": True},
    "max-autotune-no-cudagraphs": {"max_autotune": True, "coordinate_descent_tuning": True},
    "max-autotune": {"max_autotune": True, "triton.cudagraphs": True, "coordinate_descent_tuning": True},
}


# Note: eager's random numbers
# Inductor draws the random numbers of `dropout`, `rand_like`, `randn` with its own generator, seeded once per call
# from torch's: the values differ from eager's for the same seed, and torch's generator is left in another state,
# so what the program draws after a compiled call differs too (a data sampler, the next step's dropout). stampout
# compiles with Inductor's `fallback_random` (random ops run torch's own kernels, in eager's order): the same
# numbers and the same generator state as eager, at the cost of not fusing them.


def inductor_patches(backend: Any, mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    """The Inductor config patches `mode` and `options` ask for; refused at once when they cannot apply."""
    if mode is not None and mode not in MODE_OPTIONS:
        raise BackendError(message(
            f"unknown mode {mode!r}", user_location(),
            f"use one of {[None, *MODE_OPTIONS]} (torch.compile's modes), or pass Inductor settings as options=",
        ))
    if mode is not None and options is not None:
        raise BackendError(message(
            f"both mode={mode!r} and options= given", user_location(),
            "pass one of them, as with torch.compile: options= may hold the settings the mode stands for",
        ))
    if options is not None and not isinstance(options, dict):
        raise BackendError(message(
            f"options must be a dict of Inductor settings, got {type(options).__name__}", user_location(),
            "pass e.g. options={'max_autotune': True}",
        ))
    patches = dict(MODE_OPTIONS[mode]) if mode is not None else dict(options or {})
    if backend == "inductor":  # (see Note: eager's random numbers; options={"fallback_random": False} opts out)
        patches.setdefault("fallback_random", True)
    elif patches:
        raise BackendError(message(
            f"mode={mode!r} / options={options!r} configure Inductor, but backend={backend!r}", user_location(),
            "drop mode= and options=, or use backend='inductor'",
        ))
    if options:
        from ..torch_internals import inductor_config as config

        known = config.get_config_copy()
        unknown = [key for key in options if key not in known]
        if unknown:
            close = difflib.get_close_matches(unknown[0], list(known), n=3)
            raise BackendError(message(
                f"options names Inductor settings that do not exist: {unknown}", user_location(),
                f"check the name in torch._inductor.config{f' (did you mean {close}?)' if close else ''}",
            ))
    return patches


def with_patches(compile_graph: Callable[..., Any], patches: dict[str, Any]) -> Callable[..., Any]:
    """`compile_graph` run under `torch._inductor.config.patch(patches)` (the backward is lowered with the
    forward, so it sees them too), patched while no background lowering runs (which takes the patches along)."""

    def compile_with_options(gm: Any, example_inputs: list[Any]) -> Any:
        from ..torch_internals import inductor_config as config

        if patches.get("triton.cudagraphs") and not any(getattr(t, "is_cuda", False) for t in example_inputs):
            log.info("inductor: CUDA graphs asked for (mode or options), but the inputs are not on CUDA: none used")
        with background.lowering(), config.patch(patches):  # (process-wide: not while a lowering thread reads it)
            return compile_graph(gm, example_inputs)

    compile_with_options.__module__ = getattr(compile_graph, "__module__", __name__)
    return compile_with_options
