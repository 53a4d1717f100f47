"""The command line's choices, importable without torch (`stampout --help` must not import it)."""

BENCH_MODELS = ("llama-like", "user", "hf-llama", "hf-gpt2")  # user: bench/user_model.py (a checkout)
DEMO_BACKENDS = ("eager", "aot_eager", "inductor")
