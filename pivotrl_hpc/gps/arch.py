"""The tensors of each served architecture, and how vLLM's loaders split them (TP and EP).

Everything here is derived from the model's own config (a `ModelShape`): which tensors exist
and their shapes (`param_shapes`), and which rows or columns of each a parallel rank keeps
(`split_of`). Architectures, by the HF names of their tensors:

- Qwen2 (policy and GenRM): q/k/v with biases, o_proj, gate/up/down MLP, two norms a layer;
- GLM-4 (GLM-Z1): q/k/v with biases, the MLP's `gate_up_proj` fused on disk ([gate; up]
  rows) and two extra norms (`post_self_attn_layernorm`, `post_mlp_layernorm`);
- Qwen3-MoE: q/k/v without biases plus per-head `q_norm`/`k_norm`, a router (`mlp.gate`) and
  per-expert gate/up/down;
- Qwen3.5-MoE: as Qwen3-MoE with a shared expert (and its sigmoid gate), full-attention layers
  whose q_proj holds [query; gate] per head, and Gated-DeltaNet linear-attention layers
  (`linear_attn.*`: fused q/k/v projection, z, b, a, a depthwise conv1d over q/k/v, A_log,
  dt_bias, a per-head-dim norm, out_proj).

vLLM's splits (vllm 0.32 `linear.py`, `vocab_parallel_embedding.py`, `fused_moe`): a column
parallel tensor keeps rows of each of its fused parts (`MergedColumnParallelLinear` splits
every output part on its own, so a rank holds [gate_r; up_r], not a contiguous block); q/k/v
split by heads, KV heads replicated when ranks outnumber them; row parallel tensors keep
columns; the vocabulary is padded to a multiple of 64 and split in equal blocks; with expert
parallelism each rank owns whole experts (linear placement), without it every expert is split
like a dense MLP; norms, routers and gates are replicated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a shape's tensors are listed here; shapes imports this module
    from pivotrl_hpc.gps.shapes import ModelShape

VOCAB_PADDING = 64   # vLLM's DEFAULT_VOCAB_PADDING_SIZE

REPLICATED, VOCAB, COLUMN, ROW = "replicated", "vocab", "column", "row"
QK_NORM = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next")  # per-head q/k norms


@dataclass(frozen=True)
class Split:
    """How a rank's part of one tensor is chosen (dim 0 for column, dim 1 for row)."""
    kind: str
    parts: tuple[int, ...] = ()   # column: fused parts along dim 0, each split on its own
    heads: int = 0                # column: split by this many heads (KV heads may replicate)
    expert: int = -1              # the expert this tensor belongs to (-1: none)


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


_ROW_SUFFIXES = ("o_proj.weight", "down_proj.weight", "out_proj.weight")
_COLUMN_SUFFIXES = ("gate_proj.weight", "up_proj.weight", "in_proj_z.weight",
                    "in_proj_b.weight", "in_proj_a.weight", "linear_attn.A_log",
                    "linear_attn.dt_bias")


def split_of(name: str, dims: tuple[int, ...], shape: ModelShape) -> Split:
    """The split rule of tensor `name` (full shape `dims`) under vLLM's loaders."""
    expert = _expert_of(name)
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        return Split(VOCAB)
    if name.endswith(_ROW_SUFFIXES):
        return Split(ROW, expert=expert)
    if ".self_attn." in name and name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj"):
        heads = shape.num_heads if ".q_proj." in name else shape.num_kv_heads
        return Split(COLUMN, heads=heads)
    if name.endswith("gate_up_proj.weight"):
        return Split(COLUMN, parts=(dims[0] // 2,) * 2, expert=expert)
    if name.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")):
        kd, vd = linear_dims(shape)
        return Split(COLUMN, parts=(kd, kd, vd))
    if name.endswith(_COLUMN_SUFFIXES):
        return Split(COLUMN, expert=expert)
    return Split(REPLICATED)


def _expert_of(name: str) -> int:
    _, sep, tail = name.partition(".experts.")
    if not sep:
        return -1
    number = tail.split(".", 1)[0]
    return int(number) if number.isdigit() else -1
