"""The command line's choices, importable without torch (`stampout --help` must not import it)."""

BENCH_MODELS = ("llama-like", "hf-llama", "hf-gpt2")
DEMO_BACKENDS = ("eager", "aot_eager", "inductor")
