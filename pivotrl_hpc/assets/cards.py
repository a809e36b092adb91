"""Model cards: the HF config fields of the paper's models (Table 1), for runs without weights.

The simulator needs a model's dimensions (KV bytes per token, parameter bytes), never its
weights. With a card, `pivotrl simulate` runs a paper model group whose folders are not on
this machine. Each card holds the fields of the model's published `config.json` that
`gps.shapes.ModelShape` reads; `tests/test_cards.py` checks every card against the model's
published parameter count (and active count for the MoE ones), the one figure the model
cards of the hub state in prose. A folder with a `config.json` always wins over a card.
"""
from __future__ import annotations

from typing import Any


def _qwen2(vocab, hidden, inter, layers, heads, kv, tie, ctx=131072) -> dict[str, Any]:
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv,
            "max_position_embeddings": ctx, "rope_theta": 1e6, "tie_word_embeddings": tie,
            "rms_norm_eps": 1e-6}


def _qwen3_5_layer_types(layers: int, interval: int = 4) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)]


CARDS: dict[str, dict[str, Any]] = {
    "Qwen2.5-1.5B": _qwen2(151936, 1536, 8960, 28, 12, 2, tie=True),
    "Qwen2.5-7B": _qwen2(152064, 3584, 18944, 28, 28, 4, tie=False),
    "Qwen2.5-32B": _qwen2(152064, 5120, 27648, 64, 40, 8, tie=False),
    "Qwen2.5-72B": _qwen2(152064, 8192, 29568, 80, 64, 8, tie=False),
    "GLM-Z1-9B": {"architectures": ["Glm4ForCausalLM"], "model_type": "glm4",
                  "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696,
                  "num_hidden_layers": 40, "num_attention_heads": 32,
                  "num_key_value_heads": 2, "head_dim": 128, "attention_bias": True,
                  "partial_rotary_factor": 0.5, "max_position_embeddings": 32768,
                  "rope_theta": 10000.0, "tie_word_embeddings": False, "rms_norm_eps": 1e-5},
    "Qwen3-30B-A3B": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                      "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128,
                      "num_experts_per_tok": 8, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "attention_bias": False, "max_position_embeddings": 40960,
                      "rope_theta": 1e6, "tie_word_embeddings": False, "rms_norm_eps": 1e-6},
    "Qwen3.5-122B-A10B": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": {
            "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 3072,
            "num_hidden_layers": 48, "layer_types": _qwen3_5_layer_types(48),
            "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256,
            "linear_num_key_heads": 16, "linear_num_value_heads": 64,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8,
            "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
            "attention_bias": False, "max_position_embeddings": 262144,
            "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25},
            "tie_word_embeddings": False, "rms_norm_eps": 1e-6}},
}


def card_for(path: str) -> tuple[str, dict[str, Any]] | None:
    """The card of the model a folder path names (its last component, e.g. /models/Qwen2.5-7B
    or Qwen2.5-7B-Instruct: the longest card name it starts with), or None."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    matches = [c for c in CARDS if name == c or name.startswith(c + "-")]
    if not matches:
        return None
    best = max(matches, key=len)
    return best, CARDS[best]
