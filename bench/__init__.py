"""Benchmarks and the shared model zoo (bench.models)."""
