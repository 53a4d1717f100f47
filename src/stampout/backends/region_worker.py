"""A worker process of parallel.py: compiles each region it is sent exactly as the calling process would
(inductor.compile_region_graph), under the sender's settings, into the shared Inductor caches. Its own module so
that parallel.py (imported by inductor.py) does not import inductor.py back."""

from __future__ import annotations

import os
import pickle
import sys
import traceback

import torch
import torch.fx as fx

from .. import config
from . import inductor, parallel, pipeline, startup, toolchain


def serve() -> None:
    """A worker process's loop: compile each region sent on stdin, answer on stdout."""
    import select

    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # (whatever prints goes to stderr, not into the answers)
    stdin = sys.stdin.buffer
    from ..torch_internals import compile_fx  # noqa: F401 - Inductor imported before announcing readiness

    startup.fill_torch_key()
    toolchain.warm_up()
    parallel.send(out, ("ready", None))
    while select.select([stdin], [], [], parallel.IDLE_S)[0]:
        try:
            payload = parallel.receive(stdin)
        except EOFError:
            return
        try:
            _compile(payload)
            answer = ("done", None)
        except Exception:  # noqa: BLE001 - reported to the caller, which compiles the region itself
            answer = ("failed", traceback.format_exc())
        parallel.send(out, answer)


def _compile(payload: bytes) -> None:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from ..torch_internals import FakeTensorMode, GraphPickler, functorch_config, inductor_config

    name, settings, graph = pickle.loads(payload)
    subgraph, vals = GraphPickler.loads(graph, FakeTensorMode(shape_env=ShapeEnv() if settings["shape_env"] else None))
    subgraph = fx.GraphModule(subgraph, subgraph.graph, class_name=settings["class_name"])
    if torch.get_num_threads() != settings["threads"]:
        torch.set_num_threads(settings["threads"])
    parallel.set_matmul_settings(settings["matmul"])
    own_inductor, own_functorch = inductor_config.get_config_copy(), functorch_config.get_config_copy()
    with inductor_config.patch({k: v for k, v in settings["inductor"].items() if own_inductor.get(k) != v}), \
            functorch_config.patch({k: v for k, v in settings["functorch"].items() if own_functorch.get(k) != v}), \
            config.patch(**settings["stampout"]), torch.set_grad_enabled(settings["grad_enabled"]), \
            startup.scope(), pipeline.overlapped():
        inductor.compile_region_graph(subgraph, name, vals)
