"""Model shape: what the GPS layout and the converters need from an HF Qwen2 `config.json`.

Kept torch-free and I/O-light so that the planner, the simulator and the converters can all use
it. The HF config is the source of truth because the canonical GPS layout is HF's (what vLLM
loads).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    rms_norm_eps: float
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, cfg: "dict | str | os.PathLike") -> "ModelShape":
        """Build from a config dict, a `config.json` path or a model folder."""
        if not isinstance(cfg, dict):
            path = Path(cfg)
            if path.is_dir():
                path = path / "config.json"
            cfg = json.loads(path.read_text())
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=_rope_theta(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; other Qwen-family configs say so explicitly.
            qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type", "qwen2") == "qwen2")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        )

    @property
    def q_per_group(self) -> int:
        """Query heads per key/value head (one Megatron query group)."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def hf_param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every canonical HF tensor name -> shape, in the order HF writes them."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            out[p + "input_layernorm.weight"] = (h,)
            for proj, rows in (("q_proj", self.q_size), ("k_proj", self.kv_size),
                               ("v_proj", self.kv_size)):
                out[f"{p}self_attn.{proj}.weight"] = (rows, h)
                if self.qkv_bias:
                    out[f"{p}self_attn.{proj}.bias"] = (rows,)
            out[p + "self_attn.o_proj.weight"] = (h, self.q_size)
            out[p + "post_attention_layernorm.weight"] = (h,)
            out[p + "mlp.gate_proj.weight"] = (i, h)
            out[p + "mlp.up_proj.weight"] = (i, h)
            out[p + "mlp.down_proj.weight"] = (h, i)
        out["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (v, h)
        return out

    def num_params(self) -> int:
        total = 0
        for shape in self.hf_param_shapes().values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


def _rope_theta(cfg: dict[str, Any]) -> float:
    # transformers 5 keeps the rotary base in `rope_parameters`; older ones in `rope_theta`.
    params = cfg.get("rope_parameters") or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(cfg.get("rope_theta", 10000.0))
