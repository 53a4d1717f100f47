"""What the command line runs besides the library: the model zoo, the demo and the capture benchmark.

The zoo's models are user code to stampout (their globals are guarded, their lines named in errors)."""
