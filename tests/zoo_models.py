"""Tiny Hugging Face (transformers 5) and diffusers models, built in code with random weights (nothing is
downloaded), each with its inputs at two sizes: the architectures of the zoo tests (tests/zoo_checks.py, run by
tests/test_hf_zoo_*.py)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VOCAB = 128
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)


class Family(enum.Enum):
    DECODER = "decoder"
    MOE = "moe"
    STATE_SPACE = "state space"
    ENCODER = "encoder"
    ENCODER_DECODER = "encoder-decoder"
    VISION = "vision"
    MULTIMODAL = "multimodal"
    DIFFUSERS = "diffusers"


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One architecture: how to build it, its call's keyword arguments at a size, and the two sizes tried."""

    name: str
    family: Family
    build: Callable[[], nn.Module]
    inputs: Callable[[int], dict[str, Any]]
    sizes: tuple[int, int]


def _gen(size: int) -> torch.Generator:
    return torch.Generator().manual_seed(size)


def _ids(length: int, batch: int = 2, vocab: int = VOCAB, low: int = 1) -> torch.Tensor:
    return torch.randint(low, vocab, (batch, length), generator=_gen(length))


def _causal(length: int) -> dict[str, Any]:
    return dict(input_ids=_ids(length), use_cache=False)


def _padded(length: int) -> dict[str, Any]:
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, -2:] = 0  # the second sequence is padded
    return dict(input_ids=_ids(length), attention_mask=mask)


def _pixels(size: int, batch: int = 1, channels: int = 3) -> dict[str, Any]:
    return dict(pixel_values=torch.randn(batch, channels, size, size, generator=_gen(size)))


def _tf():
    import transformers

    return transformers


def _decoder(config_cls: str, model_cls: str, **overrides: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        tf = _tf()
        return getattr(tf, model_cls)(getattr(tf, config_cls)(**{**DECODER, **overrides}))

    return build


def _hf(config_cls: str, model_cls: str, **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        tf = _tf()
        return getattr(tf, model_cls)(getattr(tf, config_cls)(**config))

    return build


def _gpt2_config() -> dict[str, Any]:
    return dict(n_layer=3, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64)


DECODERS = [
    ZooModel("llama", Family.DECODER, _decoder("LlamaConfig", "LlamaForCausalLM"), _causal, (6, 9)),
    ZooModel("mistral", Family.DECODER, _decoder("MistralConfig", "MistralForCausalLM", sliding_window=None),
             _causal, (6, 9)),
    ZooModel("qwen2", Family.DECODER, _decoder("Qwen2Config", "Qwen2ForCausalLM"), _causal, (6, 9)),
    ZooModel("qwen3", Family.DECODER, _decoder("Qwen3Config", "Qwen3ForCausalLM", head_dim=8), _causal, (6, 9)),
    ZooModel("gemma", Family.DECODER, _decoder("GemmaConfig", "GemmaForCausalLM", head_dim=8), _causal, (6, 9)),
    ZooModel("gemma2", Family.DECODER, _decoder("Gemma2Config", "Gemma2ForCausalLM", head_dim=8, sliding_window=4),
             _causal, (6, 9)),
    ZooModel("gemma3", Family.DECODER, _decoder("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8,
                                                sliding_window=4, sliding_window_pattern=2), _causal, (6, 9)),
    ZooModel("phi", Family.DECODER, _decoder("PhiConfig", "PhiForCausalLM"), _causal, (6, 9)),
    ZooModel("phi3", Family.DECODER, _decoder("Phi3Config", "Phi3ForCausalLM"), _causal, (6, 9)),
    ZooModel("gpt2", Family.DECODER, _hf("GPT2Config", "GPT2LMHeadModel", **_gpt2_config()), _causal, (6, 9)),
    ZooModel("gpt_neox", Family.DECODER, _decoder("GPTNeoXConfig", "GPTNeoXForCausalLM"), _causal, (6, 9)),
    ZooModel("gptj", Family.DECODER, _hf("GPTJConfig", "GPTJForCausalLM", n_layer=3, n_embd=32, n_head=4,
                                         rotary_dim=4, vocab_size=VOCAB, n_positions=64), _causal, (6, 9)),
    ZooModel("opt", Family.DECODER, _hf("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=32,
                                        num_hidden_layers=3, ffn_dim=64, num_attention_heads=4,
                                        word_embed_proj_dim=32, max_position_embeddings=64), _causal, (6, 9)),
    ZooModel("bloom", Family.DECODER, _hf("BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=32,
                                          n_layer=3, n_head=4), _causal, (6, 9)),
    ZooModel("falcon", Family.DECODER, _hf("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=32,
                                           num_hidden_layers=3, num_attention_heads=4, new_decoder_architecture=True,
                                           num_kv_heads=2), _causal, (6, 9)),
    ZooModel("stablelm", Family.DECODER, _decoder("StableLmConfig", "StableLmForCausalLM"), _causal, (6, 9)),
    ZooModel("olmo", Family.DECODER, _decoder("OlmoConfig", "OlmoForCausalLM"), _causal, (6, 9)),
    ZooModel("cohere", Family.DECODER, _decoder("CohereConfig", "CohereForCausalLM"), _causal, (6, 9)),
]

MOE = [
    ZooModel("mixtral", Family.MOE, _decoder("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                                             num_experts_per_tok=2), _causal, (6, 9)),
    ZooModel("qwen2_moe", Family.MOE, _decoder("Qwen2MoeConfig", "Qwen2MoeForCausalLM", moe_intermediate_size=32,
                                               shared_expert_intermediate_size=32, num_experts=4,
                                               num_experts_per_tok=2), _causal, (6, 9)),
]

STATE_SPACE = [
    ZooModel("mamba", Family.STATE_SPACE, _hf("MambaConfig", "MambaForCausalLM", vocab_size=VOCAB, hidden_size=32,
                                              state_size=8, num_hidden_layers=3, expand=2, conv_kernel=4),
             _causal, (6, 9)),
    ZooModel("jamba", Family.STATE_SPACE, _decoder("JambaConfig", "JambaForCausalLM", num_hidden_layers=4,
                                                   attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                                   expert_layer_offset=1, num_experts=2, num_experts_per_tok=1,
                                                   mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                                                   use_mamba_kernels=False), _causal, (6, 9)),
]

_ENCODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=64)

ENCODERS = [
    ZooModel("bert", Family.ENCODER, _hf("BertConfig", "BertModel", **_ENCODER), _padded, (6, 9)),
    ZooModel("roberta", Family.ENCODER, _hf("RobertaConfig", "RobertaModel", **_ENCODER), _padded, (6, 9)),
    ZooModel("distilbert", Family.ENCODER, _hf("DistilBertConfig", "DistilBertModel", vocab_size=VOCAB, dim=32,
                                               n_layers=3, n_heads=4, hidden_dim=64, max_position_embeddings=64),
             _padded, (6, 9)),
    ZooModel("albert", Family.ENCODER, _hf("AlbertConfig", "AlbertModel", **_ENCODER, embedding_size=16),
             _padded, (6, 9)),
    ZooModel("electra", Family.ENCODER, _hf("ElectraConfig", "ElectraModel", **_ENCODER, embedding_size=16),
             _padded, (6, 9)),
    ZooModel("deberta_v2", Family.ENCODER, _hf("DebertaV2Config", "DebertaV2Model", **_ENCODER,
                                               relative_attention=True, position_buckets=8,
                                               pos_att_type=["p2c", "c2p"]), _padded, (6, 9)),
]


def _seq2seq(length: int) -> dict[str, Any]:
    return dict(input_ids=_ids(length), decoder_input_ids=_ids(length - 2), use_cache=False)


def _whisper(frames: int) -> dict[str, Any]:
    return dict(input_features=torch.randn(1, 16, 2 * 32, generator=_gen(frames)),
                decoder_input_ids=_ids(frames, batch=1), use_cache=False)


ENCODER_DECODERS = [
    ZooModel("t5", Family.ENCODER_DECODER, _hf("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=32,
                                               d_kv=8, d_ff=64, num_layers=3, num_heads=4, decoder_start_token_id=0),
             _seq2seq, (6, 9)),
    ZooModel("bart", Family.ENCODER_DECODER, _hf("BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB,
                                                 d_model=32, encoder_layers=3, decoder_layers=3,
                                                 encoder_attention_heads=4, decoder_attention_heads=4,
                                                 encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64),
             _seq2seq, (6, 9)),
    ZooModel("whisper", Family.ENCODER_DECODER, _hf("WhisperConfig", "WhisperForConditionalGeneration",
                                                    vocab_size=VOCAB, num_mel_bins=16, d_model=32, encoder_layers=3,
                                                    decoder_layers=3, encoder_attention_heads=4,
                                                    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                                    max_source_positions=32, max_target_positions=64,
                                                    decoder_start_token_id=1, pad_token_id=0),
             _whisper, (4, 7)),
]


def _batched_pixels(batch: int) -> dict[str, Any]:
    return _pixels(32, batch=batch)


_VIT = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, image_size=32,
            patch_size=8)


def _clip_inputs(batch: int) -> dict[str, Any]:
    return dict(**_pixels(32, batch=batch), input_ids=_ids(5, batch=batch))


def _clip(config_cls: str, text_cls: str, vision_cls: str, model_cls: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        tf = _tf()
        text = getattr(tf, text_cls)(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=16)
        vision = getattr(tf, vision_cls)(**_VIT)
        return getattr(tf, model_cls)(getattr(tf, config_cls)(text_config=text.to_dict(),
                                                               vision_config=vision.to_dict()))

    return build


VISION = [
    ZooModel("vit", Family.VISION, _hf("ViTConfig", "ViTModel", **_VIT), _batched_pixels, (1, 2)),
    ZooModel("swin", Family.VISION, _hf("SwinConfig", "SwinModel", image_size=32, patch_size=2, embed_dim=16,
                                        depths=[2, 2], num_heads=[2, 4], window_size=4), _batched_pixels,
             (1, 2)),  # two batch sizes: a symbolic image size costs torch's AOTAutograd a minute (as torch.compile)
    ZooModel("convnext", Family.VISION, _hf("ConvNextConfig", "ConvNextModel", hidden_sizes=[16, 32], depths=[2, 2],
                                            num_stages=2), lambda s: _pixels(s), (32, 48)),
    ZooModel("resnet", Family.VISION, _hf("ResNetConfig", "ResNetModel", embedding_size=16, hidden_sizes=[16, 32],
                                          depths=[2, 2], layer_type="basic"), lambda s: _pixels(s), (32, 48)),
    ZooModel("clip", Family.VISION, _clip("CLIPConfig", "CLIPTextConfig", "CLIPVisionConfig", "CLIPModel"),
             _clip_inputs, (1, 2)),
    ZooModel("siglip", Family.VISION, _clip("SiglipConfig", "SiglipTextConfig", "SiglipVisionConfig", "SiglipModel"),
             _clip_inputs, (1, 2)),
]


def llava() -> nn.Module:
    tf = _tf()
    torch.manual_seed(0)
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=16, patch_size=4, projection_dim=32)
    text = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=127, vision_feature_layer=-1)
    return tf.LlavaForConditionalGeneration(config).eval()


def llava_inputs(extra: int) -> dict[str, Any]:
    """16 image tokens (one 16x16 image in 4x4 patches), then 4 + `extra` text tokens."""
    ids = torch.cat([torch.full((1, 16), 127), torch.randint(0, 120, (1, 4 + extra), generator=_gen(extra))], 1)
    return dict(input_ids=ids, pixel_values=torch.randn(1, 3, 16, 16, generator=_gen(extra)), use_cache=False)


def qwen2_vl() -> nn.Module:
    tf = _tf()
    torch.manual_seed(0)
    config = tf.Qwen2VLConfig(
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        text_config=dict(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=0, eos_token_id=1, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        image_token_id=150, video_token_id=151, vision_start_token_id=152)
    return tf.Qwen2VLForConditionalGeneration(config).eval()


def qwen2_vl_inputs(extra: int) -> dict[str, Any]:
    """A vision-start token, the 4 merged tokens of one 16x16 image (16 patches), then 4 + `extra` text tokens."""
    ids = torch.cat([torch.tensor([[152]]), torch.full((1, 4), 150),
                     torch.randint(0, 140, (1, 4 + extra), generator=_gen(extra))], 1)
    return dict(input_ids=ids, pixel_values=torch.randn(16, 3 * 2 * 4 * 4, generator=_gen(extra)),
                image_grid_thw=torch.tensor([[1, 4, 4]]), mm_token_type_ids=(ids == 150).long(), use_cache=False)


MULTIMODAL = [
    ZooModel("llava", Family.MULTIMODAL, llava, llava_inputs, (0, 3)),
    ZooModel("qwen2_vl", Family.MULTIMODAL, qwen2_vl, qwen2_vl_inputs, (0, 3)),
]


def vae() -> nn.Module:
    import diffusers

    torch.manual_seed(0)
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
        latent_channels=4, norm_num_groups=16, sample_size=32)


def _bench_diffusers(name: str) -> tuple[Callable[[], nn.Module], Callable[[int], dict[str, Any]]]:
    """bench.common's small SD3 / Wan / PixArt (2 blocks), with its latents at a spatial size."""

    def build() -> nn.Module:
        from bench.common import diffusers_model

        return diffusers_model(name, layers=2)[0]

    def inputs(size: int) -> dict[str, Any]:
        from bench.common import diffusers_model

        kwargs = dict(diffusers_model(name, layers=1)[1])  # inputs only: the model is tiny
        latents = kwargs["hidden_states"]
        kwargs["hidden_states"] = torch.randn(*latents.shape[:-2], size, size, generator=_gen(size))
        return kwargs

    return build, inputs


def flux() -> nn.Module:
    import diffusers

    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                            pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))


def flux_inputs(tokens: int) -> dict[str, Any]:
    gen = _gen(tokens)
    return dict(hidden_states=torch.randn(1, tokens, 16, generator=gen),
                encoder_hidden_states=torch.randn(1, 5, 32, generator=gen),
                pooled_projections=torch.randn(1, 32, generator=gen), timestep=torch.tensor([0.5]),
                img_ids=torch.randint(0, 8, (tokens, 3), generator=gen).float(), txt_ids=torch.zeros(5, 3),
                return_dict=False)


def sana() -> nn.Module:
    import diffusers

    torch.manual_seed(0)
    return diffusers.SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                            attention_head_dim=16, num_layers=2, num_cross_attention_heads=2,
                                            cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=32,
                                            sample_size=16, patch_size=1)


def unet() -> nn.Module:
    import diffusers

    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=16)


def _latents(size: int, channels: int = 4, text: int = 32) -> dict[str, Any]:
    gen = _gen(size)
    return dict(hidden_states=torch.randn(1, channels, size, size, generator=gen),
                encoder_hidden_states=torch.randn(1, 5, text, generator=gen), timestep=torch.tensor([500]),
                return_dict=False)


def _unet_inputs(size: int) -> dict[str, Any]:
    kwargs = _latents(size)
    return dict(sample=kwargs.pop("hidden_states"), **kwargs)


DIFFUSERS = [
    ZooModel("flux", Family.DIFFUSERS, flux, flux_inputs, (16, 24)),
    ZooModel("sd3", Family.DIFFUSERS, *_bench_diffusers("sd3"), (16, 24)),
    ZooModel("wan", Family.DIFFUSERS, *_bench_diffusers("wan"), (16, 24)),
    ZooModel("pixart", Family.DIFFUSERS, *_bench_diffusers("pixart"), (16, 24)),
    ZooModel("sana", Family.DIFFUSERS, sana, _latents, (8, 12)),
    ZooModel("unet", Family.DIFFUSERS, unet, _unet_inputs, (16, 24)),
    ZooModel("vae", Family.DIFFUSERS, vae, lambda s: dict(sample=torch.randn(1, 3, s, s, generator=_gen(s))),
             (32, 16)),
]

ZOO = DECODERS + MOE + STATE_SPACE + ENCODERS + ENCODER_DECODERS + VISION + MULTIMODAL + DIFFUSERS
