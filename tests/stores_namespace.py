"""A module namespace the programs of test_namespace_stores.py store into (as `metrics.LAST = ...`)."""

LAST = None
