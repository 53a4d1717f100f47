"""The tracer: a program's Python run on fake tensors, its torch calls recorded as FX nodes."""
