"""Seeing reads and writes of Python objects (class patches, watches) and the world a capture leaves."""
