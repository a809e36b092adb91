"""Megatron-Core GPTModel for a Qwen2-architecture policy, built from a GPS `ModelShape`.

Local (Megatron-only) layer spec, so that the same module tree exists with and without
Transformer Engine: RMSNorm, SwiGLU MLP (fc1 = [gate; up]), rotary embeddings with the HF
config's base, grouped-query attention with q/k/v bias, untied output layer.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pivotrl_hpc.engines.megatron.parallel import device_scope, ensure_device_support
from pivotrl_hpc.gps.shapes import ModelShape

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelBuildConfig:
    tp_size: int = 1
    dtype: str = "float32"  # "float32" or "bfloat16" (bf16 params, fp32 main params in Adam)
    max_sequence_length: int = 4096
    init_seed: int = 1234  # weights are overwritten by load_hf; the seed makes builds repeatable


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def transformer_config(shape: ModelShape, build: ModelBuildConfig):
    from megatron.core.transformer.transformer_config import TransformerConfig

    if shape.tie_word_embeddings:
        raise ValueError("tied embeddings are not supported by this builder (policy is untied)")
    if shape.num_kv_heads % build.tp_size or shape.num_heads % build.tp_size:
        raise ValueError(f"heads {shape.num_heads}/{shape.num_kv_heads} not divisible by "
                         f"TP={build.tp_size}")
    dtype = torch_dtype(build.dtype)
    on_cpu = not torch.cuda.is_available()
    return TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size, num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads, kv_channels=shape.head_dim,
        tensor_model_parallel_size=build.tp_size,
        normalization="RMSNorm", layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,  # RL fine-tuning of the policy: no dropout
        # Makes DDP sum (not average) grads over DP: the GRPO loss of each rank is already
        # divided by the token count of the whole global batch.
        calculate_per_token_loss=True,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        # Weights come from GPS right after the build, so initialise on the host and skip the
        # device-side init kernels.
        use_cpu_initialization=True,
        # The bias-activation / bias-dropout fusions are TorchScript and run on any GPU.
        # The masked-softmax, RoPE and grad-accumulation fusions need Apex/TE kernels that the
        # local spec does not guarantee, so they stay off on both paths.
        bias_activation_fusion=not on_cpu, bias_dropout_fusion=not on_cpu,
        masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )


def build_gpt_model(shape: ModelShape, build: ModelBuildConfig):
    """Build this TP rank's GPTModel shard on the training device (model parallel must be up)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    device = ensure_device_support()
    if parallel_state.get_tensor_model_parallel_world_size() != build.tp_size:
        raise RuntimeError("initialize_model_parallel(tp) must run before build_gpt_model")
    config = transformer_config(shape, build)
    torch.manual_seed(build.init_seed)
    with device_scope():
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=shape.vocab_size,
            max_sequence_length=min(build.max_sequence_length, shape.max_position_embeddings),
            position_embedding_type="rope",
            rotary_base=int(shape.rope_theta),  # Megatron's default 10000 is wrong for Qwen2
            share_embeddings_and_output_weights=False,
            parallel_output=True,  # keep logits vocab-parallel; the loss gathers what it needs
        )
    model = model.to(device)
    log.info("GPTModel shard built: %d parameters on %s (TP=%d)",
             sum(p.numel() for p in model.parameters()), device, build.tp_size)
    return model
