"""Benchmarks: side-by-side runs against torch.compile (models live in stampout.tools.models)."""
