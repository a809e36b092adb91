"""Converters between the canonical GPS layout (HF Qwen2 names and shapes) and Megatron-Core.

Megatron-Core GPTModel with the local layer spec (megatron-core 0.16.1) names and lays out a
Qwen2 model like this (see shared/reference/megatron-cpu/REPORT.md §3):

- `embedding.word_embeddings.weight`, `output_layer.weight`: vocabulary-parallel, split on dim 0
  (Megatron may pad the vocabulary; padding rows are dropped on the way back);
- `decoder.layers.N.self_attention.linear_qkv.{weight,bias}`: grouped layout. Per query group
  g (one per KV head) the rows are [q heads of g; k head g; v head g], and TP splits across
  groups, so a rank holds whole groups. A plain cat([Q; K; V]) would be wrong;
- `...linear_proj.weight` (o_proj) and `...mlp.linear_fc2.weight` (down_proj): row-parallel,
  split on dim 1;
- `...mlp.linear_fc1.weight` = [gate; up], and per TP rank [gate shard; up shard], so a gather
  is per half, not a cat of the rank shards;
- norms replicated. `_extra_state` entries carry no data and are skipped.

The rotary base is not a tensor: the Megatron side must be configured with
`shape.rope_theta` (Megatron's default of 10000 silently differs from Qwen2's).

All three functions only reshape and slice, so round trips are bitwise exact. Outputs may share
memory with the inputs (views) where no reshuffle is needed.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from pivotrl_hpc.gps.shapes import ModelShape

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Megatron per-layer suffix -> HF per-layer suffix, for the one-to-one tensors.
_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_ROW_PARALLEL = {"self_attention.linear_proj.weight", "mlp.linear_fc2.weight"}
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
Index = tuple[slice, ...]


def _check_tp(shape: ModelShape, tp_size: int) -> None:
    if tp_size < 1 or shape.num_kv_heads % tp_size or shape.intermediate_size % tp_size:
        raise ValueError(f"TP={tp_size} must divide num_kv_heads={shape.num_kv_heads} and "
                         f"intermediate_size={shape.intermediate_size} (Megatron query groups)")
    if shape.hidden_size % tp_size:
        raise ValueError(f"TP={tp_size} must divide hidden_size={shape.hidden_size}")


def _chunk(n: int, tp_size: int, tp_rank: int) -> slice:
    step = n // tp_size
    return slice(tp_rank * step, (tp_rank + 1) * step)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] >= rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def _grouped_qkv(q: Tensor, k: Tensor, v: Tensor, shape: ModelShape, groups: slice) -> Tensor:
    """HF q/k/v (weight or bias) -> Megatron grouped rows for the query groups `groups`."""
    ng, hd, qpg = shape.num_kv_heads, shape.head_dim, shape.q_per_group
    tail = q.shape[1:]
    parts = (q.reshape(ng, qpg * hd, *tail)[groups], k.reshape(ng, hd, *tail)[groups],
             v.reshape(ng, hd, *tail)[groups])
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _split_qkv(qkv: Tensor, shape: ModelShape) -> tuple[Tensor, Tensor, Tensor]:
    """Megatron grouped rows (any whole number of groups) -> (q, k, v) rows of those groups."""
    hd, qpg = shape.head_dim, shape.q_per_group
    tail = qkv.shape[1:]
    g = qkv.reshape(-1, (qpg + 2) * hd, *tail)
    q, k, v = g.split([qpg * hd, hd, hd], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def hf_to_megatron(hf: Mapping[str, Tensor], shape: ModelShape, tp_rank: int, tp_size: int,
                   *, padded_vocab_size: int | None = None) -> dict[str, Tensor]:
    """This TP rank's Megatron-Core GPTModel (local spec) state-dict shard, Megatron names.

    `padded_vocab_size` is Megatron's padded vocabulary (default: the vocabulary rounded up to
    a multiple of TP); padding rows are zeros.
    """
    _check_tp(shape, tp_size)
    v = padded_vocab_size or -(-shape.vocab_size // tp_size) * tp_size
    vocab = _chunk(v, tp_size, tp_rank)
    groups = _chunk(shape.num_kv_heads, tp_size, tp_rank)
    cols_h = _chunk(shape.q_size, tp_size, tp_rank)
    inter = _chunk(shape.intermediate_size, tp_size, tp_rank)
    out = {"embedding.word_embeddings.weight":
           _pad_rows(hf["model.embed_tokens.weight"], v)[vocab].contiguous()}
    for n in range(shape.num_layers):
        p, m = f"model.layers.{n}.", f"decoder.layers.{n}."
        a = p + "self_attn."
        out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = _grouped_qkv(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], shape,
            groups)
        if shape.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _grouped_qkv(
                hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], shape,
                groups)
        out[m + "self_attention.linear_proj.weight"] = \
            hf[a + "o_proj.weight"][:, cols_h].contiguous()
        out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[p + "mlp.gate_proj.weight"][inter], hf[p + "mlp.up_proj.weight"][inter]])
        out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"][:, inter].contiguous()
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not shape.tie_word_embeddings:
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], v)[vocab].contiguous()
    return out


def megatron_to_hf(shards: Sequence[Mapping[str, Tensor]], shape: ModelShape) -> dict[str, Tensor]:
    """All TP ranks' shards (index = TP rank) -> full canonical HF tensors."""
    tp_size = len(shards)
    _check_tp(shape, tp_size)
    pieces: dict[str, list[tuple[Index, Tensor]]] = {}
    for rank, shard in enumerate(shards):
        for name, index, values in megatron_shard_to_hf_slices(shard, shape, rank, tp_size):
            pieces.setdefault(name, []).append((index, values))
    full_shapes = shape.hf_param_shapes()
    out: dict[str, Tensor] = {}
    for name, full in full_shapes.items():
        parts = pieces.get(name)
        if not parts:
            raise KeyError(f"no Megatron shard provides {name}")
        dst = torch.empty(full, dtype=parts[0][1].dtype)
        for index, values in parts:  # replicated tensors are written once per rank, identically
            dst[index] = values
        out[name] = dst
    return out


def megatron_shard_to_hf_slices(shard: Mapping[str, Tensor], shape: ModelShape, tp_rank: int,
                                tp_size: int) -> list[tuple[str, Index, Tensor]]:
    """One rank's shard -> [(HF name, index into the full canonical tensor, values)].

    Lets a training rank Write its part without a gather. Replicated tensors (norms) come from
    every rank; a writer may keep only tp_rank 0's.
    """
    _check_tp(shape, tp_size)
    out: list[tuple[str, Index, Tensor]] = []
    for name, t in shard.items():
        if name.endswith("_extra_state") or t is None:
            continue
        if name in _TOP:
            out.extend(_top_slices(name, t, shape, tp_rank))
            continue
        m = _LAYER.match(name)
        if m is None:
            raise KeyError(f"unknown Megatron parameter {name}")
        out.extend(_layer_slices(int(m.group(1)), m.group(2), t, shape, tp_rank, tp_size))
    return out


def _top_slices(name: str, t: Tensor, shape: ModelShape, tp_rank: int):
    hf_name = _TOP[name]
    if name == "decoder.final_layernorm.weight":
        return [(hf_name, (slice(None),), t)]
    rows = t.shape[0]  # per-rank rows; Megatron's padding makes the last ranks run past V
    start = tp_rank * rows
    end = min(start + rows, shape.vocab_size)
    if start >= end:
        return []
    return [(hf_name, (slice(start, end), slice(None)), t[: end - start])]


def _layer_slices(n: int, suffix: str, t: Tensor, shape: ModelShape, tp_rank: int,
                  tp_size: int) -> list[tuple[str, Index, Tensor]]:
    p = f"model.layers.{n}."
    full = slice(None)
    if suffix in _SIMPLE:
        hf_name = p + _SIMPLE[suffix]
        if suffix in _ROW_PARALLEL:
            cols = t.shape[1]
            return [(hf_name, (full, slice(tp_rank * cols, (tp_rank + 1) * cols)), t)]
        return [(hf_name, (full,), t)]
    if suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]  # weight | bias
        q, k, v = _split_qkv(t, shape)
        groups = shape.num_kv_heads // tp_size
        g0 = tp_rank * groups
        qs = shape.q_per_group * shape.head_dim
        hd = shape.head_dim
        tail = (full,) * (t.dim() - 1)
        return [(p + f"self_attn.q_proj.{kind}", (slice(g0 * qs, (g0 + groups) * qs), *tail), q),
                (p + f"self_attn.k_proj.{kind}", (slice(g0 * hd, (g0 + groups) * hd), *tail), k),
                (p + f"self_attn.v_proj.{kind}", (slice(g0 * hd, (g0 + groups) * hd), *tail), v)]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = t.chunk(2, dim=0)
        rows = gate.shape[0]
        idx = (slice(tp_rank * rows, (tp_rank + 1) * rows), full)
        return [(p + "mlp.gate_proj.weight", idx, gate), (p + "mlp.up_proj.weight", idx, up)]
    raise KeyError(f"unknown Megatron layer parameter decoder.layers.{n}.{suffix}")
