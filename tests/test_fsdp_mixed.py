"""FSDP2 mixed precision (`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`) on 2 gloo ranks:
stampout.capture and compile(aot_eager) train as eager (tests/distributed_worker.py: `fsdp_mixed`)."""

from __future__ import annotations

from distributed_ranks import on_ranks, ranks_fixture, skip_without_gloo

needs_gloo = skip_without_gloo()
ranks = ranks_fixture("distributed_worker")
MIXED = "fsdp_mixed"
# bf16 compute: eager and stampout run the same bf16 ops, so they agree far below bf16's resolution (2**-8)
TOLERANCE = 2.0**-10


@needs_gloo
@on_ranks(MIXED)
def test_fsdp_mixed_precision_capture_trains_as_eager(ranks):
    """The hooks cast each block's inputs to bf16: the captured graph's boundary outputs are bf16 fakes (its
    blocks' region traced in bf16, once), and 3 SGD steps give eager's loss and full fp32 gradients."""
    reports = ranks(MIXED)
    for report in reports:
        for variant in ("capture", "aot_eager"):
            rows = report[variant]["rows"]
            assert len(rows) == 3
            for row in rows:
                assert row["params"] == 39 and row["missing"] == []
                assert row["loss"] <= TOLERANCE and row["grad"] <= TOLERANCE, (variant, rows)
            world = report[variant]["world"]
            assert world["sharded"] and world["forwards"] == [] and world["param"] <= TOLERANCE
        stats = report["capture"]["stats"]
        assert (stats["traces"], stats["reuses"]) == (1, 3)
        assert "torch.bfloat16" in stats["dtypes"]
    assert reports[0]["capture"]["stats"] == reports[1]["capture"]["stats"]
