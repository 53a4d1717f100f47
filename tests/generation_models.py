"""Small Hugging Face decoders (random weights, nothing downloaded) for the generation tests."""

from __future__ import annotations

import torch

VOCAB = 128


def build(name: str, layers: int = 3) -> torch.nn.Module:
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if name == "llama":
        config, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif name == "qwen3":
        config, cls = tf.Qwen3Config(**common, head_dim=8), tf.Qwen3ForCausalLM
    elif name == "mistral":
        config, cls = tf.MistralConfig(**common, sliding_window=None), tf.MistralForCausalLM
    elif name == "gemma2":
        config, cls = tf.Gemma2Config(**common, head_dim=8, sliding_window=4), tf.Gemma2ForCausalLM
    elif name == "gpt2":
        config, cls = tf.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64), \
            tf.GPT2LMHeadModel
    elif name == "mixtral":
        config, cls = tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2), tf.MixtralForCausalLM
    elif name == "qwen3_moe":
        config = tf.Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=32, num_experts=4,
                                   num_experts_per_tok=2, decoder_sparse_step=1)
        cls = tf.Qwen3MoeForCausalLM
    else:
        raise ValueError(name)
    torch.manual_seed(0)
    model = cls(config).eval()
    model.generation_config.disable_compile = True  # HF must not compile on its own
    return model


PROMPT = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
NEW_TOKENS = 4


def greedy(model, cache: str, prompt: torch.Tensor = PROMPT):
    """`model.generate` greedy, NEW_TOKENS tokens, with its per-step logits."""
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation=cache,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)


def assert_same_generation(got, expected) -> None:
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.logits) == len(expected.logits) == NEW_TOKENS
    for step, (a, b) in enumerate(zip(got.logits, expected.logits)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, s=step: f"step {s}: {m}")


MODELS = ("llama", "qwen3", "mistral", "gpt2", "gemma2", "mixtral", "qwen3_moe")
