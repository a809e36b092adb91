"""The tensors of each served architecture, and how vLLM's loaders split them (TP and EP).

Everything here is derived from the model's own config (a `ModelShape`, whose
`hf_param_shapes` lists the tensors in `gps/shapes.py`): which rows or columns of each tensor
a parallel rank keeps (`split_of`). Architectures, by the HF names of their tensors:

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

from pivotrl_hpc.gps.shapes import ModelShape, linear_dims

VOCAB_PADDING = 64   # vLLM's DEFAULT_VOCAB_PADDING_SIZE

REPLICATED, VOCAB, COLUMN, ROW = "replicated", "vocab", "column", "row"


@dataclass(frozen=True)
class Split:
    """How a rank's part of one tensor is chosen (dim 0 for column, dim 1 for row)."""
    kind: str
    parts: tuple[int, ...] = ()   # column: fused parts along dim 0, each split on its own
    heads: int = 0                # column: split by this many heads (KV heads may replicate)
    expert: int = -1              # the expert this tensor belongs to (-1: none)


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
