"""2 gloo ranks: grouped `fully_shard([a, b])`, FSDP2 + tensor parallelism on 2-D (dp, tp) meshes, and tensor
parallelism under Inductor — stampout.compile (per backend) and stampout.capture train as eager, and the
sharded blocks are one region trace (tests/distributed_mesh_worker.py; all of this file's scenarios in one pair
of rank processes, tests/distributed_ranks.py)."""

from __future__ import annotations

import pytest
from distributed_ranks import on_ranks, ranks_fixture, skip_without_gloo

needs_gloo = skip_without_gloo()
ranks = ranks_fixture("distributed_mesh_worker")
GROUPED = "grouped"
MESHES = {"mesh_1x2": "mesh:1x2", "mesh_2x1": "mesh:2x1"}
TP_INDUCTOR = "tp_inductor"


def _trains_as_eager(result: dict, params: int, tol: float = 1e-6) -> None:
    assert "error" not in result, f"{result.get('error')}\n{result.get('traceback', '')}"
    for row in result["rows"]:
        assert row["params"] == params and row["missing"] == []
        assert row["loss"] <= tol and row["grad"] <= tol, result["rows"]


@needs_gloo
@on_ranks(GROUPED)
@pytest.mark.parametrize("variant", ["eager", "aot_eager", "capture"])
def test_grouped_fully_shard_trains_as_eager(ranks, variant):
    """`fully_shard([layers[0], layers[1]])`: one FSDP group over two blocks (its per-module hooks are wrappers
    made per module, guarded by the function they wrap), so the 4 blocks are 1 trace and 3 reuses."""
    reports = ranks(GROUPED)
    for report in reports:
        result = report[variant]
        _trains_as_eager(result, 36)
        assert result["world"]["sharded"] and result["world"]["param"] <= 1e-6
        assert (result["stats"]["traces"], result["stats"]["reuses"]) == (1, 3), result["stats"]
    assert reports[0][variant]["stats"] == reports[1][variant]["stats"]


@needs_gloo
@on_ranks(*MESHES.values())
@pytest.mark.parametrize("shape", list(MESHES))
@pytest.mark.parametrize("variant", ["eager", "aot_eager", "capture"])
def test_fsdp_with_tensor_parallel_on_a_2d_mesh(ranks, shape, variant):
    """Blocks tensor parallel on the "tp" dim and sharded on the "dp" dim of a (dp, tp) mesh (FSDP's unsharded
    parameters are tp DTensors): eager's gradients, one trace for the 4 blocks (each block's `mesh["tp"]` is a
    new DeviceMesh, equal by value), and both ranks capture the same program."""
    reports = ranks(MESHES[shape])
    for report in reports:
        result = report[variant]
        _trains_as_eager(result, 16)
        assert result["world"]["sharded"] and result["world"]["param"] <= 1e-6
        assert (result["stats"]["traces"], result["stats"]["reuses"]) == (1, 3), result["stats"]
    assert reports[0][variant]["stats"] == reports[1][variant]["stats"]


@needs_gloo
@pytest.mark.inductor
@on_ranks(TP_INDUCTOR)
def test_tensor_parallel_regions_under_inductor(ranks):
    """Two tensor-parallel blocks in regions (regions="auto") through Inductor: one trace, eager's gradients."""
    reports = ranks(TP_INDUCTOR)
    for report in reports:
        result = report["inductor"]
        _trains_as_eager(result, 8, tol=1e-5)
        assert (result["stats"]["traces"], result["stats"]["reuses"]) == (1, 1)
    assert reports[0]["inductor"]["stats"] == reports[1]["inductor"]["stats"]
