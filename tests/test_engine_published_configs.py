"""Every family loads with transformers' default config and with the config.json of its
published checkpoints, and reads it as transformers' modeling code does: each layer's
window, head_dim, kv heads, the attention scale, soft-caps, biases and output gate from
the attention modules transformers builds (on the meta device, so no weights are made),
each layer's rope (inv_freq over the rotary dims, attention factor) from transformers'
rotary embedding, and for the Gated DeltaNet hybrids each layer's mixer and the shapes of
the linear-attention modules."""

import dataclasses
import json

import pytest
import torch
import transformers

from engine.layers import rope_inv_freq
from engine.loader import ModelConfig

from .close import rtol_atol

CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
    "Qwen2MoeForCausalLM": "Qwen2MoeConfig",
    "MixtralForCausalLM": "MixtralConfig",
    "Gemma2ForCausalLM": "Gemma2Config",
    "Gemma3ForCausalLM": "Gemma3TextConfig",
    "GptOssForCausalLM": "GptOssConfig",
    "Qwen3NextForCausalLM": "Qwen3NextConfig",
    "Qwen3_5ForCausalLM": "Qwen3_5TextConfig",
    "Qwen3_5MoeForCausalLM": "Qwen3_5MoeTextConfig",
    "Gemma3ForConditionalGeneration": "Gemma3Config",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5Config",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeConfig",
}
# the multimodal wrappers: transformers builds their text model from text_config
TEXT_MODEL = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}

# The config.json files as published (transformers 4 spellings: rope_theta/rope_scaling
# at top level, torch_dtype, Gemma 3's rope_local_base_freq and sliding_window_pattern;
# Qwen3.5's already rope_parameters, with partial_rotary_factor and the mrope fields).
# Copied from repositories that quote the files; where a file was not found whole, the
# comment says what was used instead.
PUBLISHED = {
    # quoted, citing huggingface.co/mistralai/Mistral-7B-v0.1/resolve/main/config.json
    "mistralai/Mistral-7B-v0.1": """{
  "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.34.0.dev0", "use_cache": true, "vocab_size": 32000}""",
    "Qwen/Qwen2.5-7B-Instruct": """{
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
  "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
  "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
  "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
  "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.43.1", "use_cache": true, "use_sliding_window": false,
  "vocab_size": 152064}""",
    # quoted from the ModelScope copy of the file
    "Qwen/Qwen3-8B": """{
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
  "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
  "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
  "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
  "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": null,
  "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": true,
  "use_sliding_window": false, "vocab_size": 151936}""",
    # the file itself was not found: this is the config of its quantized copies
    # (lmstudio-community/Qwen3-30B-A3B-MLX-4bit, a GPTQ copy), which agree on every
    # field but their quantization fields, left out here
    "Qwen/Qwen3-30B-A3B": """{
  "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false,
  "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
  "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
  "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
  "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
  "moe_intermediate_size": 768, "norm_topk_prob": true, "num_attention_heads": 32,
  "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
  "num_key_value_heads": 4, "output_router_logits": false, "rms_norm_eps": 1e-06,
  "rope_scaling": null, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
  "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
  "vocab_size": 151936}""",
    # Qwen/Qwen1.5-MoE-A2.7B's own file was not found: this is the published
    # Qwen/Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4 config.json without its quantization_config
    # (see QUANTIZED)
    "Qwen/Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4": """{
  "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0,
  "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 5632, "max_position_embeddings": 32768, "max_window_layers": 21,
  "model_type": "qwen2_moe", "moe_intermediate_size": 1408, "norm_topk_prob": false,
  "num_attention_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
  "num_hidden_layers": 24, "num_key_value_heads": 16, "output_router_logits": false,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
  "shared_expert_intermediate_size": 5632, "sliding_window": 32768,
  "tie_word_embeddings": false, "torch_dtype": "float16",
  "transformers_version": "4.39.0.dev0", "use_cache": true, "use_sliding_window": false,
  "vocab_size": 151936}""",
    # quoted, citing huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json
    "mistralai/Mixtral-8x7B-v0.1": """{
  "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
  "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
  "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
  "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
  "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.36.0.dev0", "use_cache": true, "vocab_size": 32000}""",
    # quoted, citing huggingface.co/google/gemma-2-2b-it/blob/main/config.json
    "google/gemma-2-2b-it": """{
  "architectures": ["Gemma2ForCausalLM"], "attention_bias": false,
  "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2,
  "cache_implementation": "hybrid", "eos_token_id": [1, 107],
  "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
  "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
  "initializer_range": 0.02, "intermediate_size": 9216, "max_position_embeddings": 8192,
  "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26,
  "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
  "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
  "torch_dtype": "bfloat16", "transformers_version": "4.42.4", "use_cache": true,
  "vocab_size": 256000}""",
    "google/gemma-3-1b-it": """{
  "architectures": ["Gemma3ForCausalLM"], "attention_bias": false,
  "attention_dropout": 0.0, "attn_logit_softcapping": null, "bos_token_id": 2,
  "cache_implementation": "hybrid", "eos_token_id": [1, 106],
  "final_logit_softcapping": null, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912,
  "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
  "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
  "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
  "rope_scaling": null, "rope_theta": 1000000, "sliding_window": 512,
  "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
  "transformers_version": "4.50.0.dev0", "use_cache": true, "vocab_size": 262144}""",
    # text_config verbatim (as quoted from mlx-community/gemma-3-4b-it-4bit, which keeps
    # google's); the top level and vision_config as quoted for google/gemma-3-27b-it,
    # whose wrapper and SigLIP tower are the same
    "google/gemma-3-4b-it": """{
  "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
  "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
  "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
  "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
    "model_type": "gemma3_text", "num_hidden_layers": 34,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
  "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
  "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
    "model_type": "siglip_vision_model", "num_attention_heads": 16,
    "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": false}}""",
    # without its quantization_config (see QUANTIZED)
    "openai/gpt-oss-20b": """{
  "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
  "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
  "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
  "intermediate_size": 2880,
  "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
    "full_attention", "sliding_attention", "full_attention", "sliding_attention",
    "full_attention", "sliding_attention", "full_attention", "sliding_attention",
    "full_attention", "sliding_attention", "full_attention", "sliding_attention",
    "full_attention", "sliding_attention", "full_attention", "sliding_attention",
    "full_attention", "sliding_attention", "full_attention", "sliding_attention",
    "full_attention"],
  "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
  "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
  "num_local_experts": 32, "output_router_logits": false, "pad_token_id": 199999,
  "rms_norm_eps": 1e-5,
  "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
    "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
  "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
  "swiglu_limit": 7.0, "tie_word_embeddings": false, "transformers_version": "4.55.0.dev0",
  "use_cache": true, "vocab_size": 201088}""",
    # meta-llama/Llama-3.1-8B's file as quoted byte for byte (from NousResearch's copy),
    # with the Instruct model's eos_token_id list, the field in which the two differ
    "meta-llama/Llama-3.1-8B-Instruct": """{
  "architectures": ["LlamaForCausalLM"], "attention_bias": false,
  "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
  "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": false,
  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.42.3", "use_cache": true, "vocab_size": 128256}""",
    # the published file as quoted for a one-layer debug copy that shrank three fields
    # (num_hidden_layers 1, vocab_size 1519, bos/eos 1516), every other field kept: those
    # three are the release's here (48 layers per the model card; the Qwen tokenizer's
    # 151936 and 151643/151645, as in the Qwen3-Next quotes that keep them)
    "Qwen/Qwen3-Next-80B-A3B-Instruct": """{
  "architectures": ["Qwen3NextForCausalLM"], "attention_dropout": 0.0,
  "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
  "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
  "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4,
  "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
  "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
  "model_type": "qwen3_next", "moe_intermediate_size": 512, "norm_topk_prob": true,
  "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10,
  "num_hidden_layers": 48, "num_key_value_heads": 2, "output_router_logits": false,
  "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": null,
  "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
  "shared_expert_intermediate_size": 512, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.57.0.dev0", "use_cache": true,
  "use_sliding_window": false, "vocab_size": 151936}""",
    # quoted whole, as fetched from huggingface.co/Qwen/Qwen3.5-0.8B/resolve/main/config.json
    # (a dense Qwen3.5: tied embeddings, as many value heads as key heads)
    "Qwen/Qwen3.5-0.8B": """{
  "architectures": ["Qwen3_5ForConditionalGeneration"], "image_token_id": 248056,
  "model_type": "qwen3_5",
  "text_config": {"attention_bias": false, "attention_dropout": 0.0,
    "attn_output_gate": true, "dtype": "bfloat16", "eos_token_id": 248044,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3584,
    "layer_types": [
    "linear_attention", "linear_attention", "linear_attention", "full_attention",
    "linear_attention", "linear_attention", "linear_attention", "full_attention",
    "linear_attention", "linear_attention", "linear_attention", "full_attention",
    "linear_attention", "linear_attention", "linear_attention", "full_attention",
    "linear_attention", "linear_attention", "linear_attention", "full_attention",
    "linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 16, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_5_text",
    "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": false,
    "num_attention_heads": 8, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "tie_word_embeddings": true, "use_cache": true,
    "vocab_size": 248320, "mamba_ssm_dtype": "float32",
    "rope_parameters": {"mrope_interleaved": true, "mrope_section": [11, 11, 10],
      "rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}},
  "tie_word_embeddings": true, "transformers_version": "4.57.0.dev0",
  "video_token_id": 248057,
  "vision_config": {"deepstack_visual_indexes": [], "depth": 12,
    "hidden_act": "gelu_pytorch_tanh", "hidden_size": 768, "in_channels": 3,
    "initializer_range": 0.02, "intermediate_size": 3072, "model_type": "qwen3_5",
    "num_heads": 12, "num_position_embeddings": 2304, "out_hidden_size": 1024,
    "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
  "vision_end_token_id": 248054, "vision_start_token_id": 248053}""",
    # Qwen/Qwen3.5-35B-A3B's file as a fine-tune keeps it unchanged (InternScience/
    # Agents-A1's config.json, quoted whole: Qwen's transformers 4.57.0.dev0 and field
    # order); every field agrees with Qwen3.5-35B-A3B's config as loaded by transformers 5.7
    "Qwen/Qwen3.5-35B-A3B": """{
  "architectures": ["Qwen3_5MoeForConditionalGeneration"], "image_token_id": 248056,
  "model_type": "qwen3_5_moe",
  "text_config": {"attention_bias": false, "attention_dropout": 0.0,
    "attn_output_gate": true, "dtype": "bfloat16", "eos_token_id": 248044,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02,
    "layer_types": [
    "linear_attention", "linear_attention", "linear_attention", "full_attention",
    "linear_attention", "linear_attention", "linear_attention", "full_attention",
    "linear_attention", "linear_attention", "linear_attention", "full_attention",
    "linear_attention", "linear_attention", "linear_attention", "full_attention",
    "linear_attention", "linear_attention", "linear_attention", "full_attention",
    "linear_attention", "linear_attention", "linear_attention", "full_attention",
    "linear_attention", "linear_attention", "linear_attention", "full_attention",
    "linear_attention", "linear_attention", "linear_attention", "full_attention",
    "linear_attention", "linear_attention", "linear_attention", "full_attention",
    "linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "mlp_only_layers": [],
    "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 512,
    "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": false,
    "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8,
    "num_hidden_layers": 40, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512,
    "use_cache": true, "vocab_size": 248320, "mamba_ssm_dtype": "float32",
    "rope_parameters": {"mrope_interleaved": true, "mrope_section": [11, 11, 10],
      "rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}},
  "tie_word_embeddings": false, "transformers_version": "4.57.0.dev0",
  "video_token_id": 248057,
  "vision_config": {"deepstack_visual_indexes": [], "depth": 27,
    "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152, "in_channels": 3,
    "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_5_moe",
    "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048,
    "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
  "vision_end_token_id": 248054, "vision_start_token_id": 248053}""",
}
# GPT-OSS's published quantization_config: its MXFP4 experts run quantised
GPT_OSS_MXFP4 = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
# the quantization_config other published files carry (GPTQ's: its scalar fields, the
# module lists left out): refused by name
QUANTIZED = {
    "Qwen/Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4": (
        {"bits": 4, "desc_act": False, "group_size": 128, "quant_method": "gptq", "sym": True},
        "'gptq'",
    ),
}


def hf_config(d):
    """transformers' config object of a config.json dict (a wrapper's: its text model's)."""
    arch = d["architectures"][0]
    kw = {k: v for k, v in d.items() if k != "architectures"}
    cfg = getattr(transformers, CONFIG_CLASSES[arch])(**kw)
    if arch in TEXT_MODEL:
        return TEXT_MODEL[arch], cfg.text_config
    return arch, cfg


def hf_reading(cfg):
    """What transformers' modeling code reads of ``cfg``, from the modules it builds: per
    layer its mixer; for an attention layer the window (-1: none), head_dim, kv heads,
    q_proj rows (twice the heads' where q_proj carries the output gate), scale, soft-cap,
    biases and rope (inv_freq over the rotary dims, attention factor); for a Gated
    DeltaNet layer its heads, head dims and conv kernel. And the final soft-cap and the
    class of the model built."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    rotary = type(model.model.rotary_emb)(cfg)  # on the CPU: its inv_freq has values
    # each layer's token mixer: self_attn, or the hybrids' linear_attn (Gated DeltaNet)
    mixers = [getattr(x, "self_attn", None) or x.linear_attn for x in model.model.layers]
    attns = [m for m in mixers if hasattr(m, "k_proj")]
    kinds = getattr(cfg, "layer_types", None)
    # a window per layer where the attention modules keep one (Qwen2-MoE: on its sliding
    # layers only); else the one the mask reads for every layer (Mistral, Mixtral; Llama
    # has none)
    # (with layer_types, a module without one is a full-attention layer)
    per_layer = kinds is not None or any(hasattr(a, "sliding_window") for a in attns)
    out = []
    for i, a in enumerate(mixers):
        if not hasattr(a, "k_proj"):  # Qwen3NextGatedDeltaNet, Qwen3_5(Moe)GatedDeltaNet
            gdn = dict(
                num_k_heads=a.num_k_heads,
                num_v_heads=a.num_v_heads,
                k_head_dim=a.head_k_dim,
                v_head_dim=a.head_v_dim,
                conv_kernel=a.conv_kernel_size,
            )
            out.append(dict(mixer="linear_attention", gdn=gdn, conv_dim=a.conv1d.in_channels))
            continue
        if per_layer:
            window = getattr(a, "sliding_window", None)
        else:
            window = getattr(cfg, "sliding_window", None)
        prefix = f"{kinds[i]}_" if hasattr(rotary, f"{kinds and kinds[i]}_inv_freq") else ""
        inv_freq = getattr(rotary, prefix + "inv_freq")
        out.append(
            dict(
                mixer="attention",
                window=window or -1,
                head_dim=a.head_dim,
                kv_heads=a.k_proj.out_features // a.head_dim,
                q_rows=a.q_proj.out_features,
                scale=a.scaling,
                softcap=getattr(a, "attn_logit_softcapping", None) or 0.0,
                qkv_bias=a.q_proj.bias is not None,
                o_bias=a.o_proj.bias is not None,
                rotary_dim=2 * inv_freq.numel(),
                inv_freq=inv_freq,
                rope_factor=getattr(rotary, prefix + "attention_scaling"),
            )
        )
    return out, getattr(cfg, "final_logit_softcapping", None) or 0.0, type(model).__name__


def assert_reads_as_transformers(d):
    c = ModelConfig.from_hf_dict(d)
    arch, cfg = hf_config(d)
    layers, final_cap, built = hf_reading(cfg)
    assert c.architecture == arch == built
    assert c.text_of == (d["architectures"][0] if d["architectures"][0] in TEXT_MODEL else None)
    assert c.num_hidden_layers == len(layers)
    assert c.logit_softcap == final_cap
    ropes = c.layer_ropes or [(c.rope_theta, c.rope_scaling)] * c.num_hidden_layers
    for i, (want, (theta, scaling)) in enumerate(zip(layers, ropes)):
        assert c.layer_mixers[i] == want["mixer"], f"layer {i}"
        if want["mixer"] == "linear_attention":
            assert dataclasses.asdict(c.gdn) == want["gdn"], f"layer {i}"
            assert c.gdn.conv_dim == want["conv_dim"], f"layer {i}"
            continue
        rot = int(c.head_dim * c.partial_rotary_factor)  # as engine.models.decoder's Rotary
        got = dict(
            window=c.layer_windows[i],
            head_dim=c.head_dim,
            kv_heads=c.num_key_value_heads,
            q_rows=(2 if c.attn_output_gate else 1) * c.num_attention_heads * c.head_dim,
            scale=c.attn_scale or c.head_dim**-0.5,
            softcap=c.attn_softcap,
            qkv_bias=c.qkv_bias,
            o_bias=c.attention_bias,
            rotary_dim=rot,
        )
        assert got == {k: want[k] for k in got}, f"layer {i}"
        inv, factor = rope_inv_freq(rot, theta, scaling, c.max_position_embeddings)
        torch.testing.assert_close(inv, want["inv_freq"].float(), **rtol_atol("rope_inv_freq"))
        assert factor == pytest.approx(want["rope_factor"], rel=1e-12), f"layer {i}"
    for field in ("vocab_size", "hidden_size", "num_attention_heads", "rms_norm_eps"):
        assert getattr(c, field) == getattr(cfg, field), field
    return c


@pytest.mark.parametrize("arch", [a for a in CONFIG_CLASSES if a.endswith("CausalLM")])
def test_transformers_default_config(arch):
    """The dict of ``transformers.<Family>Config()`` (every field at its class default)."""
    _, cfg = hf_config({"architectures": [arch]})
    d = dict(cfg.to_dict(), architectures=[arch])
    assert_reads_as_transformers(d)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_config(name):
    c = assert_reads_as_transformers(json.loads(PUBLISHED[name]))
    if c.architecture in ("MistralForCausalLM", "GptOssForCausalLM", "Gemma2ForCausalLM"):
        assert any(w > 0 for w in c.layer_windows)  # the windows these files switch on


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_published_quantization_config_is_refused_by_name(name):
    quant, method = QUANTIZED[name]
    d = dict(json.loads(PUBLISHED[name]), quantization_config=quant)
    with pytest.raises(ValueError, match=f"quantization_config.*{method}"):
        ModelConfig.from_hf_dict(d)


def test_published_gpt_oss_mxfp4_config_is_read():
    d = dict(json.loads(PUBLISHED["openai/gpt-oss-20b"]), quantization_config=GPT_OSS_MXFP4)
    assert ModelConfig.from_hf_dict(d).quant_method == "mxfp4"


def test_gemma3_4b_text_config_takes_the_class_defaults():
    """google/gemma-3-4b-it's text_config leaves out the heads, head_dim, vocabulary and
    rope bases: transformers' Gemma3TextConfig defaults fill them (8 heads, 4 kv heads
    of 256, theta 1e6 with the file's linear factor 8 on the full layers, 1e4 local)."""
    c = ModelConfig.from_hf_dict(json.loads(PUBLISHED["google/gemma-3-4b-it"]))
    _, cfg = hf_config(json.loads(PUBLISHED["google/gemma-3-4b-it"]))
    assert c.text_of == "Gemma3ForConditionalGeneration"
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    )
    full = [r for r, w in zip(c.layer_ropes, c.layer_windows) if w < 0]
    assert len(full) == 34 // 6 and full[0] == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert c.eos_token_id == [1, 106] and c.torch_dtype == "bfloat16"


# fields a config.json may leave out whose class defaults differ between families
# (num_key_value_heads: the heads or 4, 8, 16, 32; head_dim: hidden / heads or 64, 128,
# 256; sliding_window: none, 128 or 4096)
LEFT_OUT = ("num_key_value_heads", "head_dim", "sliding_window")
# the families whose window use_sliding_window switches on (the Gated DeltaNet hybrids,
# Qwen3-Next and Qwen3.5, have no window: test_gdn_hybrids_read_no_window)
QWEN_WINDOWED = (
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
)
GDN_CAUSAL_LMS = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")


@pytest.mark.parametrize("arch", [a for a in CONFIG_CLASSES if a.endswith("CausalLM")])
@pytest.mark.parametrize("field", LEFT_OUT)
def test_a_field_left_out_takes_the_class_default(arch, field):
    """A family's default config without ``field``: the engine reads what transformers'
    config class and modeling code read (its class default, not the engine's guess).
    Qwen2/Qwen3 switch the window on, so a left-out window is seen."""
    _, cfg = hf_config({"architectures": [arch]})
    d = dict(cfg.to_dict(), architectures=[arch])
    if arch in QWEN_WINDOWED:
        d.update(use_sliding_window=True, max_window_layers=1)
        d["sliding_window"] = d.get("sliding_window") or 48  # Qwen2-MoE saves 0 unused
    d.pop(field, None)
    if field == "num_key_value_heads" and d.get("num_attention_heads", 32) % 32 == 0:
        d["num_attention_heads"] = 64  # a multiple of every class default
    assert_reads_as_transformers(d)


@pytest.mark.parametrize("arch", GDN_CAUSAL_LMS)
def test_gdn_hybrids_read_no_window(arch):
    """transformers' Qwen3-Next and Qwen3.5 attention modules and masks have no sliding
    window: a config.json naming one (switched off, as Qwen3's files name theirs) reads
    as full attention on every attention layer."""
    _, cfg = hf_config({"architectures": [arch]})
    d = dict(cfg.to_dict(), architectures=[arch], sliding_window=4096, use_sliding_window=False)
    assert_reads_as_transformers(d)
