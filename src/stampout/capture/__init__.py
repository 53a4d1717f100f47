"""A capture: `capture_program` in named steps, the `Capture` it returns, its inputs and effects."""
