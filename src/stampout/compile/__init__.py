"""What `stampout.compile` returns: `CompiledFunction`, its entries, piecewise compile, per-call checks."""
