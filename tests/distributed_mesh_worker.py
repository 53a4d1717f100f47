"""The scenarios of tests/test_fsdp_mesh.py (run on 2 gloo ranks by tests/distributed_ranks.py): grouped
`fully_shard([a, b])`, FSDP2 + tensor parallelism on 2-D meshes, and tensor parallelism under Inductor.

Each case trains the model eagerly and through stampout (compile per backend, and capture) from the same
initial weights and reports per step the loss difference and the largest full-gradient difference, with the
region counts; a case that raises reports its error instead, so one failure does not hide the others.
"""

from __future__ import annotations

import traceback

import distributed_worker as worker
import torch
import torch.distributed as dist
from torch import nn

import stampout


def variants(make, names: list[str], steps: int = 3, regions: str | None = None) -> dict:
    """eager vs each stampout variant ("capture", or a compile backend) of the model `make()` builds."""
    ref = make()
    eager = worker._sgd_steps(ref, ref, steps)
    out = {}
    for name in names:
        stampout.reset()
        model = make()
        try:
            if name == "capture":
                cap = stampout.capture(model, torch.randn(2, 4, 16))
                got = worker._sgd_steps(model, cap, steps)
                stats = {"traces": cap.stats.traces, "reuses": cap.stats.reuses, "code": worker.region_code(cap)}
            else:
                fn = stampout.compile(model, backend=name, regions=regions)
                got = worker._sgd_steps(model, fn, steps)
                full = worker.stampout_stats(fn)
                stats = {k: full[k] for k in ("traces", "reuses", "captures", "recaptures", "code")}
            out[name] = {"rows": worker.differences(eager, got), "stats": stats,
                         "world": worker.world_after(model, ref)}
        except Exception as error:
            out[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
    return out


def grouped() -> nn.Module:
    """4 blocks sharded two by two (`fully_shard([a, b])`: one FSDP group over two modules), and the root."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = worker.Stack(depth=4)
    fully_shard([model.layers[0], model.layers[1]])
    fully_shard([model.layers[2], model.layers[3]])
    return fully_shard(model)


def two_d(shape: tuple[int, int]):
    """4 MLP blocks: gate/up column-wise and down row-wise on the "tp" mesh dim, each block and the root
    `fully_shard`ed on the "dp" dim, of a (dp, tp) mesh of shape `shape`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))

    def make() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(*(worker.MLPBlock(16) for _ in range(4)))
        for block in model:
            parallelize_module(block.mlp, mesh["tp"], {"gate": ColwiseParallel(), "up": ColwiseParallel(),
                                                       "down": RowwiseParallel()})
            fully_shard(block, mesh=mesh["dp"])
        return fully_shard(model, mesh=mesh["dp"])

    return make


def tensor_parallel_pair() -> nn.Module:
    """2 MLP blocks, tensor parallel on both ranks (a tiny case for Inductor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(*(worker.MLPBlock(16) for _ in range(2)))
    for block in model:
        parallelize_module(block.mlp, mesh, {"gate": ColwiseParallel(), "up": ColwiseParallel(),
                                             "down": RowwiseParallel()})
    return model


def mesh(shape: str) -> dict:
    """FSDP2 + tensor parallelism on a (dp, tp) mesh of `shape` ("1x2" or "2x1")."""
    dp, tp = (int(n) for n in shape.split("x"))
    return variants(two_d((dp, tp)), ["eager", "aot_eager", "capture"])


SCENARIOS = {
    "grouped": lambda: variants(grouped, ["eager", "aot_eager", "capture"]),
    "mesh": mesh,
    "tp_inductor": lambda: variants(tensor_parallel_pair, ["inductor"], steps=2, regions="auto"),
}
