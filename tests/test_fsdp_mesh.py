"""2 gloo ranks: grouped `fully_shard([a, b])`, FSDP2 + tensor parallelism on 2-D (dp, tp) meshes, and tensor
parallelism under Inductor — stampout.compile (per backend) and stampout.capture train as eager, and the
sharded blocks are one region trace (tests/distributed_mesh_worker.py; processes as in test_fsdp.py)."""

from __future__ import annotations

import os

import pytest
from test_fsdp import needs_gloo, run_ranks

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_mesh_worker.py")


@pytest.fixture(scope="module")
def mesh_reports(tmp_path_factory) -> list[dict]:
    return run_ranks("mesh:grouped:mesh_1x2:mesh_2x1", tmp_path_factory.mktemp("mesh"), worker=_WORKER)


def _trains_as_eager(result: dict, params: int, tol: float = 1e-6) -> None:
    assert "error" not in result, f"{result.get('error')}\n{result.get('traceback', '')}"
    for row in result["rows"]:
        assert row["params"] == params and row["missing"] == []
        assert row["loss"] <= tol and row["grad"] <= tol, result["rows"]


@needs_gloo
@pytest.mark.parametrize("variant", ["eager", "aot_eager", "capture"])
def test_grouped_fully_shard_trains_as_eager(mesh_reports, variant):
    """`fully_shard([layers[0], layers[1]])`: one FSDP group over two blocks (its per-module hooks are wrappers
    made per module, guarded by the function they wrap), so the 4 blocks are 1 trace and 3 reuses."""
    for report in mesh_reports:
        result = report["grouped"][variant]
        _trains_as_eager(result, 36)
        assert result["world"]["sharded"] and result["world"]["param"] <= 1e-6
        assert (result["stats"]["traces"], result["stats"]["reuses"]) == (1, 3), result["stats"]
    assert mesh_reports[0]["grouped"][variant]["stats"] == mesh_reports[1]["grouped"][variant]["stats"]


@needs_gloo
@pytest.mark.parametrize("shape", ["mesh_1x2", "mesh_2x1"])
@pytest.mark.parametrize("variant", ["eager", "aot_eager", "capture"])
def test_fsdp_with_tensor_parallel_on_a_2d_mesh(mesh_reports, shape, variant):
    """Blocks tensor parallel on the "tp" dim and sharded on the "dp" dim of a (dp, tp) mesh (FSDP's unsharded
    parameters are tp DTensors): eager's gradients, one trace for the 4 blocks (each block's `mesh["tp"]` is a
    new DeviceMesh, equal by value), and both ranks capture the same program."""
    for report in mesh_reports:
        result = report[shape][variant]
        _trains_as_eager(result, 16)
        assert result["world"]["sharded"] and result["world"]["param"] <= 1e-6
        assert (result["stats"]["traces"], result["stats"]["reuses"]) == (1, 3), result["stats"]
    assert mesh_reports[0][shape][variant]["stats"] == mesh_reports[1][shape][variant]["stats"]


@needs_gloo
@pytest.mark.inductor
def test_tensor_parallel_regions_under_inductor(tmp_path):
    """Two tensor-parallel blocks in regions (regions="auto") through Inductor: one trace, eager's gradients."""
    reports = run_ranks("mesh:tp_inductor", tmp_path, worker=_WORKER)
    for report in reports:
        result = report["tp_inductor"]["inductor"]
        _trains_as_eager(result, 8, tol=1e-5)
        assert (result["stats"]["traces"], result["stats"]["reuses"]) == (1, 1)
    assert reports[0]["tp_inductor"]["inductor"]["stats"] == reports[1]["tp_inductor"]["inductor"]["stats"]
