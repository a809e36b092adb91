"""Model shape: what the GPS layout and the converters need from an HF `config.json`.

Kept torch-free and I/O-light so that the planner, the simulator and the converters can all use
it. The HF config is the source of truth because the canonical GPS layout is HF's (what vLLM
loads). Dense Qwen2 is the policy architecture (Megatron converters); the GenRM may also be
GLM-4, Qwen3-MoE or Qwen3.5-MoE (`param_shapes` lists their tensors, `gps/arch.py` their
splits). A multimodal config's `text_config` is the language model's shape.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


# architectures whose full-attention q_proj also computes an output gate per head
GATED_ATTENTION = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


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
    architecture: str = "Qwen2ForCausalLM"
    model_type: str = "qwen2"
    # mixture of experts (0: dense); `mlp_only_layers` are dense layers of an MoE model
    num_experts: int = 0
    num_experts_per_tok: int = 0      # routed experts a token passes through (top-k)
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    # hybrid attention (Qwen3.5): per-layer "linear_attention" | "full_attention"; () all full
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    attn_output_gate: bool = False   # q_proj rows hold [query; gate] per head (Qwen3.5)

    @classmethod
    def from_hf_config(cls, cfg: "dict | str | os.PathLike") -> "ModelShape":
        """Build from a config dict, a `config.json` path or a model folder."""
        if not isinstance(cfg, dict):
            path = Path(cfg)
            if path.is_dir():
                path = path / "config.json"
            cfg = json.loads(path.read_text())
        top = cfg
        if isinstance(cfg.get("text_config"), dict):   # multimodal wrapper: its language model
            cfg = {**cfg["text_config"], "architectures": top.get("architectures")}
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        model_type = str(cfg.get("model_type", "qwen2")).removesuffix("_text")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
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
            architecture=str((cfg.get("architectures") or ["Qwen2ForCausalLM"])[0]),
            model_type=model_type,
            **_moe_fields(cfg), **_linear_attention_fields(cfg),
            attn_output_gate=model_type in GATED_ATTENTION or bool(cfg.get("attn_output_gate")),
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, n: int) -> bool:
        return self.is_moe and n not in self.mlp_only_layers

    def is_linear_attention(self, n: int) -> bool:
        return bool(self.layer_types) and self.layer_types[n] == "linear_attention"

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """K and V of one token over the layers that keep them (linear-attention layers hold
        a fixed-size state instead)."""
        layers = sum(1 for n in range(self.num_layers) if not self.is_linear_attention(n))
        return 2 * layers * self.kv_size * itemsize

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
        return param_shapes(self)

    def num_params(self) -> int:
        total = 0
        for shape in self.hf_param_shapes().values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def num_active_params(self) -> float:
        """Parameters one token passes through: all but the routed experts, and top-k of
        those (the MoE models' published "active" count)."""
        total = self.num_params()
        if not self.is_moe:
            return float(total)
        experts = self.routed_expert_params()
        return total - experts + experts * self.num_experts_per_tok / self.num_experts

    def routed_expert_params(self) -> int:
        """Parameters of the routed experts (0 for a dense model; shared experts not)."""
        return sum(math.prod(v) for k, v in self.hf_param_shapes().items()
                   if ".experts." in k)


# The tensors of each architecture (the list in gps/arch.py's docstring), by HF name.
QK_NORM = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next")  # per-head q/k norms


def _layer(shape: ModelShape, n: int) -> dict[str, tuple[int, ...]]:
    h, p = shape.hidden_size, f"model.layers.{n}."
    out: dict[str, tuple[int, ...]] = {p + "input_layernorm.weight": (h,)}
    out.update(_linear_attention(shape, p) if shape.is_linear_attention(n) else _attention(
        shape, p))
    out[p + "post_attention_layernorm.weight"] = (h,)
    if shape.model_type == "glm4":
        out[p + "post_self_attn_layernorm.weight"] = (h,)
        out[p + "post_mlp_layernorm.weight"] = (h,)
    out.update(_moe(shape, p) if shape.is_moe_layer(n) else _mlp(shape, p + "mlp."))
    return out


def _attention(shape: ModelShape, p: str) -> dict[str, tuple[int, ...]]:
    h, a = shape.hidden_size, p + "self_attn."
    q_rows = shape.q_size * (2 if shape.attn_output_gate else 1)
    out: dict[str, tuple[int, ...]] = {}
    for proj, rows in (("q_proj", q_rows), ("k_proj", shape.kv_size), ("v_proj", shape.kv_size)):
        out[f"{a}{proj}.weight"] = (rows, h)
        if shape.qkv_bias:
            out[f"{a}{proj}.bias"] = (rows,)
    out[a + "o_proj.weight"] = (h, shape.q_size)
    if shape.model_type in QK_NORM:
        out[a + "q_norm.weight"] = (shape.head_dim,)
        out[a + "k_norm.weight"] = (shape.head_dim,)
    return out


def linear_dims(shape: ModelShape) -> tuple[int, int]:
    """(key_dim, value_dim) of a Gated-DeltaNet layer: all heads' q (= k) and v rows."""
    return (shape.linear_num_key_heads * shape.linear_key_head_dim,
            shape.linear_num_value_heads * shape.linear_value_head_dim)


def _linear_attention(shape: ModelShape, p: str) -> dict[str, tuple[int, ...]]:
    h, a = shape.hidden_size, p + "linear_attn."
    kd, vd = linear_dims(shape)
    nv = shape.linear_num_value_heads
    return {a + "A_log": (nv,), a + "conv1d.weight": (2 * kd + vd, 1,
                                                      shape.linear_conv_kernel_dim),
            a + "dt_bias": (nv,), a + "in_proj_a.weight": (nv, h), a + "in_proj_b.weight": (nv, h),
            a + "in_proj_qkv.weight": (2 * kd + vd, h), a + "in_proj_z.weight": (vd, h),
            a + "norm.weight": (shape.linear_value_head_dim,), a + "out_proj.weight": (h, vd)}


def _mlp(shape: ModelShape, p: str, inter: int | None = None) -> dict[str, tuple[int, ...]]:
    h, i = shape.hidden_size, inter or shape.intermediate_size
    if shape.model_type == "glm4":
        return {p + "down_proj.weight": (h, i), p + "gate_up_proj.weight": (2 * i, h)}
    return {p + "gate_proj.weight": (i, h), p + "up_proj.weight": (i, h),
            p + "down_proj.weight": (h, i)}


def _moe(shape: ModelShape, p: str) -> dict[str, tuple[int, ...]]:
    h = shape.hidden_size
    out: dict[str, tuple[int, ...]] = {}
    for e in range(shape.num_experts):
        out.update(_mlp(shape, f"{p}mlp.experts.{e}.", shape.moe_intermediate_size))
    out[p + "mlp.gate.weight"] = (shape.num_experts, h)
    if shape.shared_expert_intermediate_size:
        out.update(_mlp(shape, p + "mlp.shared_expert.", shape.shared_expert_intermediate_size))
        out[p + "mlp.shared_expert_gate.weight"] = (1, h)
    return out


def param_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of the model -> its shape (names sorted within a layer as HF saves)."""
    h, v = shape.hidden_size, shape.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(shape.num_layers):
        out.update(_layer(shape, n))
    out["model.norm.weight"] = (h,)
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    return out


def itemsize(dtype: str) -> int:
    """Bytes of one element of a config `dtype` ("float32": 4, the 16-bit ones 2)."""
    return 4 if dtype == "float32" else 2


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    # Qwen3-MoE / Qwen3.5-MoE say num_experts; Mixtral-style configs num_local_experts
    n = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not n:
        return {}
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    dense |= {i for i in range(int(cfg["num_hidden_layers"])) if (i + 1) % step}
    return {"num_experts": n, "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 0),
            "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
            "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size")
                                                   or 0),
            "mlp_only_layers": tuple(sorted(dense))}


def _linear_attention_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    types = tuple(cfg.get("layer_types") or ())
    if "linear_attention" not in types:
        return {}
    return {"layer_types": types,
            **{k: int(cfg[k]) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                        "linear_key_head_dim", "linear_value_head_dim",
                                        "linear_conv_kernel_dim")}}


def _rope_theta(cfg: dict[str, Any]) -> float:
    # transformers 5 keeps the rotary base in `rope_parameters`; older ones in `rope_theta`.
    params = cfg.get("rope_parameters") or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(cfg.get("rope_theta", 10000.0))
