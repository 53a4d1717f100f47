"""Sharded modules nested in other structure, on 2 gloo ranks (tests/distributed_worker.py: `fsdp_nested`):
inside a user's region (`stampout.region` around a block whose attention and MLP are fully_shard'ed), and below a
non-root sharded block (each block and its MLP sharded)."""

from __future__ import annotations

from distributed_ranks import on_ranks, ranks_fixture, skip_without_gloo

needs_gloo = skip_without_gloo()
ranks = ranks_fixture("distributed_worker")
MARKED = "fsdp_nested:marked"
BELOW = "fsdp_nested:below"


def _trains_as_eager(result: dict) -> None:
    assert "error" not in result, result
    assert len(result["rows"]) == 2
    for row in result["rows"]:
        assert row["params"] == 18 and row["missing"] == []
        assert row["loss"] <= 1e-6 and row["grad"] <= 1e-6, result["rows"]
    assert result["world"]["sharded"] and result["world"]["forwards"] == [] and result["world"]["param"] <= 1e-6


@needs_gloo
@on_ranks(BELOW)
def test_fsdp_sharded_below_a_sharded_block(ranks):
    """A block's MLP sharded on its own inside the sharded block: capture and compile(aot_eager) give eager's loss
    and full gradients, on both ranks."""
    for report in ranks(BELOW):
        _trains_as_eager(report["capture"])
        _trains_as_eager(report["aot_eager"])


@needs_gloo
@on_ranks(MARKED)
def test_fsdp_sharded_inside_a_user_region(ranks):
    """compile(aot_eager) trains as eager (the region's module runs its code eagerly around its sharded children);
    capture refuses with what to do: a stamped-out call of the region would run the hooks of the sharded module
    it was traced with."""
    for report in ranks(MARKED):
        _trains_as_eager(report["aot_eager"])
        error = report["capture"]["error"]
        assert "layers.0.block.attn is called inside a region" in error
        assert "remove the region marker around it" in error and "stampout.compile" in error
