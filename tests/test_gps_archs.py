"""GPS Read(M, G, P) for the paper's GenRM architectures (GLM-4, Qwen3-MoE, Qwen3.5-MoE) and
Qwen2: the tensors a config implies, the slices of every tensor at TP1, TP2 and EP2 against an
independent restatement of vLLM's loaders, and the slices put back together giving
transformers' own logits.

The reference below is written from vLLM 0.32's loaders (models/{qwen2,glm4,qwen3_moe,qwen3_5}.py,
layers/linear.py, vocab_parallel_embedding.py, mamba_mixer2's sharded loader) with torch's
chunk/split and vLLM's own vocabulary and expert-placement helpers, not with the project's
slice arithmetic.
"""
from __future__ import annotations

import pytest
import torch

from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.gps.shapes import ModelShape

ARCHS = ["qwen2", "glm4", "qwen3_moe", "qwen3_5_moe"]
MOE = {"qwen3_moe", "qwen3_5_moe"}
TP2 = [ParallelPlace(2, r) for r in range(2)]
EP2 = [ParallelPlace(tp_size=2, tp_rank=r, ep_size=2, ep_rank=r) for r in range(2)]

# HF tensor suffix -> how the vLLM layer that loads it splits it over TP
VLLM_LAYER = {
    "self_attn.q_proj": "qkv_q", "self_attn.k_proj": "qkv_kv", "self_attn.v_proj": "qkv_kv",
    "self_attn.o_proj": "row", "gate_proj": "column", "up_proj": "column",
    "gate_up_proj": "merged2", "down_proj": "row", "linear_attn.in_proj_qkv": "merged_qkv",
    "linear_attn.conv1d": "merged_qkv", "linear_attn.in_proj_z": "column",
    "linear_attn.in_proj_b": "column", "linear_attn.in_proj_a": "column",
    "linear_attn.A_log": "column", "linear_attn.dt_bias": "column",
    "linear_attn.out_proj": "row",
}


def folder(arch, tiny_models, genrm_archs):
    return tiny_models / "genrm" if arch == "qwen2" else genrm_archs[arch]


def hf_tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def _kind(name: str) -> str:
    stem = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
    for suffix, kind in VLLM_LAYER.items():
        if stem.endswith("." + suffix):
            return kind
    return "replicated"


def vllm_slice(name: str, t: torch.Tensor, cfg: dict, place: ParallelPlace):
    """What vLLM's loader keeps of `t` on this rank, or None for an expert it does not own."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        pad_vocab_size, vocab_range_from_global_vocab_size)

    tp, r = place.tp_size, place.tp_rank
    if ".experts." in name:
        _, expert_map, _ = determine_expert_map(place.ep_size, place.ep_rank,
                                                cfg.get("num_experts") or cfg["num_local_experts"])
        expert = int(name.split(".experts.")[1].split(".")[0])
        if expert_map is not None and expert_map[expert] < 0:
            return None
        if place.ep_size > 1:
            return t
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        lo, hi = vocab_range_from_global_vocab_size(pad_vocab_size(t.shape[0]), r, tp)
        return t[lo:min(hi, t.shape[0])]
    kind = _kind(name)
    if tp == 1 or kind == "replicated":
        return t
    if kind == "row":
        return t.chunk(tp, dim=1)[r]
    if kind == "qkv_kv" and cfg["num_key_value_heads"] < tp:
        kv = cfg["num_key_value_heads"]
        return t.chunk(kv)[r // (tp // kv)]
    if kind == "merged2":
        return torch.cat([p.chunk(tp)[r] for p in t.chunk(2)])
    if kind == "merged_qkv":
        kd = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
        vd = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
        return torch.cat([p.chunk(tp)[r] for p in t.split([kd, kd, vd])])
    return t.chunk(tp)[r]   # column, qkv_q, qkv_kv


def places(arch: str) -> list[ParallelPlace]:
    return [ParallelPlace()] + TP2 + (EP2 if arch in MOE else [])


@pytest.fixture(scope="module")
def models(tiny_models, genrm_archs):
    return {a: folder(a, tiny_models, genrm_archs) for a in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_the_config_implies_every_tensor_of_the_folder(arch, models):
    shape = ModelShape.from_hf_config(models[arch])
    want = {k: tuple(v.shape) for k, v in hf_tensors(models[arch]).items()}
    assert shape.hf_param_shapes() == want
    assert shape.num_params() == sum(v.numel() for v in hf_tensors(models[arch]).values())


def test_shapes_read_each_architecture_from_its_config(models):
    glm, moe, q35 = (ModelShape.from_hf_config(models[a]) for a in ARCHS[1:])
    assert (glm.model_type, glm.qkv_bias, glm.num_experts) == ("glm4", True, 0)
    assert (moe.num_experts, moe.mlp_only_layers, moe.qkv_bias) == (4, (0,), False)
    assert moe.is_moe_layer(1) and not moe.is_moe_layer(0)
    assert q35.architecture == "Qwen3_5MoeForCausalLM" and q35.attn_output_gate
    assert [q35.is_linear_attention(n) for n in range(3)] == [True, True, False]
    assert q35.shared_expert_intermediate_size == 512


def test_a_multimodal_wrapper_config_gives_its_text_model(models):
    import json
    text = json.loads((models["qwen3_5_moe"] / "config.json").read_text())
    wrapped = {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
               "model_type": "qwen3_5_moe", "text_config": text, "vision_config": {}}
    shape = ModelShape.from_hf_config(wrapped)
    assert shape.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert shape.hf_param_shapes() == ModelShape.from_hf_config(text).hf_param_shapes()


@pytest.fixture(scope="module")
def agent(models):
    from pivotrl_hpc.gps.local import local_agent
    with local_agent({a: str(p) for a, p in models.items()}) as a:
        yield a


@pytest.mark.parametrize("arch", ARCHS)
def test_gps_read_equals_vllm_loader_slicing_for_every_tensor(arch, models, agent):
    import json
    pytest.importorskip("vllm")
    hf = hf_tensors(models[arch])
    cfg = json.loads((models[arch] / "config.json").read_text())
    client = agent.client()
    for place in places(arch):
        got = client.read(arch, place)
        want = {n: s for n, t in hf.items()
                if (s := vllm_slice(n, t, cfg, place)) is not None}
        assert got.keys() == want.keys(), (place, sorted(got.keys() ^ want.keys())[:4])
        for name, t in want.items():
            assert got[name].shape == t.shape and torch.equal(got[name], t), (place, name)
    if arch in MOE:  # EP2: each rank owns 2 of the 4 experts of a sparse layer, whole
        a, b = (client.read(arch, p) for p in EP2)
        assert {n for n in a if ".experts." in n}.isdisjoint(n for n in b if ".experts." in n)


def _reassemble(reads: list[dict], cfg: dict, hf: dict) -> dict[str, torch.Tensor]:
    """Full tensors from the ranks' slices, placed by the reference's rule."""
    out = {}
    for name, t in hf.items():
        full = torch.full_like(t, float("nan"))
        idx = torch.arange(t.numel()).view(t.shape).to(torch.float64)
        for place, got in reads:
            if name not in got:
                continue
            where = vllm_slice(name, idx, cfg, place).long().flatten()
            full.view(-1)[where] = got[name].flatten()
        out[name] = full
    return out


def _logits(path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([[5, 17, 99, 3, 250, 8, 41, 300, 2]])).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_slices_put_back_together_give_transformers_logits(arch, models, agent, tmp_path):
    """transformers loads the reassembled tensors through its own checkpoint conversion
    (fused experts in memory), from a folder like the model's."""
    import json
    import shutil

    from safetensors.torch import save_file
    pytest.importorskip("vllm")
    cfg = json.loads((models[arch] / "config.json").read_text())
    hf = hf_tensors(models[arch])
    want = _logits(models[arch])
    client = agent.client()
    for i, group in enumerate([TP2] + ([EP2] if arch in MOE else [])):
        full = _reassemble([(p, client.read(arch, p)) for p in group], cfg, hf)
        assert not any(torch.isnan(t).any() for t in full.values()), "a slice was never read"
        out = tmp_path / f"g{i}"
        out.mkdir()
        shutil.copy(models[arch] / "config.json", out)
        save_file(full, str(out / "model.safetensors"))
        assert (_logits(out) - want).abs().max() < 1e-5


@pytest.mark.parametrize("vocab", [500, 512, 151_936, 151_665])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_vocabulary_split_is_vllms(vocab, tp):
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        pad_vocab_size, vocab_range_from_global_vocab_size)

    from pivotrl_hpc.gps.layout import vocab_rows
    pytest.importorskip("vllm")
    for r in range(tp):
        lo, hi = vocab_range_from_global_vocab_size(pad_vocab_size(vocab), r, tp)
        assert vocab_rows(vocab, ParallelPlace(tp, r)) == slice(min(lo, vocab), min(hi, vocab))
