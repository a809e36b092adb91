"""HF Qwen2 <-> Megatron-Core converters: bitwise round trips at TP = 1, 2, 4."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pivotrl_hpc.gps.convert import hf_to_megatron, megatron_shard_to_hf_slices, megatron_to_hf
from pivotrl_hpc.gps.shapes import ModelShape


def _load(folder):
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("model", ["policy", "genrm"])
def test_shape_from_config(tiny_models, model):
    shape = ModelShape.from_hf_config(tiny_models / model)
    hf = _load(tiny_models / model)
    assert shape.rope_theta == 1e6 and shape.qkv_bias and not shape.tie_word_embeddings
    assert {k: tuple(v.shape) for k, v in hf.items()} == shape.hf_param_shapes()
    assert shape.num_params() == sum(v.numel() for v in hf.values())


@pytest.mark.parametrize("model", ["policy", "genrm"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_bitwise(tiny_models, model, tp):
    shape = ModelShape.from_hf_config(tiny_models / model)
    hf = _load(tiny_models / model)
    shards = [hf_to_megatron(hf, shape, r, tp) for r in range(tp)]
    back = megatron_to_hf(shards, shape)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_megatron_layout_tp2(tiny_models):
    """The layout Megatron itself uses (REPORT.md §3): grouped QKV, [gate; up] per rank."""
    shape = ModelShape.from_hf_config(tiny_models / "policy")
    hf = _load(tiny_models / "policy")
    h, hd, qpg = shape.hidden_size, shape.head_dim, shape.q_per_group
    s1 = hf_to_megatron(hf, shape, 1, 2)
    qkv = s1["decoder.layers.0.self_attention.linear_qkv.weight"]
    groups = shape.num_kv_heads // 2
    assert qkv.shape == (groups * (qpg + 2) * hd, h)
    g = qkv.view(groups, (qpg + 2) * hd, h)
    q = hf["model.layers.0.self_attn.q_proj.weight"].view(shape.num_kv_heads, qpg * hd, h)
    k = hf["model.layers.0.self_attn.k_proj.weight"].view(shape.num_kv_heads, hd, h)
    assert torch.equal(g[0, : qpg * hd], q[groups])
    assert torch.equal(g[0, qpg * hd: (qpg + 1) * hd], k[groups])
    fc1 = s1["decoder.layers.0.mlp.linear_fc1.weight"]
    half = shape.intermediate_size // 2
    assert torch.equal(fc1[:half], hf["model.layers.0.mlp.gate_proj.weight"][half:])
    assert torch.equal(fc1[half:], hf["model.layers.0.mlp.up_proj.weight"][half:])
    assert torch.equal(s1["decoder.layers.1.mlp.linear_fc2.weight"],
                       hf["model.layers.1.mlp.down_proj.weight"][:, half:])
    assert torch.equal(s1["output_layer.weight"], hf["lm_head.weight"][256:])


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_slices_cover_every_byte(tiny_models, tp):
    shape = ModelShape.from_hf_config(tiny_models / "genrm")
    hf = _load(tiny_models / "genrm")
    written = {k: torch.full_like(v, float("nan")) for k, v in hf.items()}
    for r in range(tp):
        shard = hf_to_megatron(hf, shape, r, tp)
        shard["decoder.layers.0.self_attention.core_attention._extra_state"] = None
        for name, index, values in megatron_shard_to_hf_slices(shard, shape, r, tp):
            written[name][index] = values
    for k in hf:
        assert torch.equal(written[k], hf[k]), k


def test_padded_vocab_round_trip(tiny_models):
    """Megatron pads the vocabulary to a multiple of 128 * TP; padding is dropped on return."""
    shape = ModelShape.from_hf_config(tiny_models / "policy")
    hf = _load(tiny_models / "policy")
    shards = [hf_to_megatron(hf, shape, r, 4, padded_vocab_size=1024) for r in range(4)]
    assert shards[3]["embedding.word_embeddings.weight"].abs().sum() == 0
    back = megatron_to_hf(shards, shape)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_bad_tp_is_refused(tiny_models):
    shape = ModelShape.from_hf_config(tiny_models / "policy")
    with pytest.raises(ValueError, match="TP=8"):
        hf_to_megatron(_load(tiny_models / "policy"), shape, 0, 8)
