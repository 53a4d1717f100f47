"""stampout."""
