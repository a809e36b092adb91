"""Each engine's KV cache from its device (issue 49, gps/memory.py): device memory x
gpu_memory_utilization - weight shard - activation workspace, a replica's the sum over its
GPUs, the same for the live adapter (runtime/spec.py) and the scheduler, live and
simulated (controller/live.py's loop_config). Figures worked out by hand from the H20's
96 GB and the models' published configs (the stand-in cards)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from pivotrl_hpc.config import ConfigError, load_config
from pivotrl_hpc.launch.preflight import check_kv_capacity
from pivotrl_hpc.controller.live import loop_config
from pivotrl_hpc.gps.shapes import ModelShape
from pivotrl_hpc.runtime.spec import engine_options
from pivotrl_hpc.sim.standin import stand_in

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
H20 = 96 * GiB
OLD_GENRM_TOKENS = 40960 * 2**20 // 98304   # the 7B config's 40 GiB per replica, before


def group(name: str, tmp_path, *overrides: str):
    cfg, _ = stand_in(load_config(ROOT / "configs" / f"{name}.yaml", list(overrides),
                                  check_files=False), tmp_path)
    return cfg


def by_hand(cfg, model: str, batched: int = 16384) -> tuple[int, int]:
    """(KV bytes a device, tokens a replica): 0.9 of 96 GiB less the weight shard, less
    one forward pass of 16,384 tokens (2 hidden + 3 x FFN width / tp, bf16) and the
    sampler's fp32 logits and probabilities of 256 sequences."""
    m = getattr(cfg.models, model)
    s, tp = ModelShape.from_hf_config(m.path), m.tensor_parallel
    ffn = (s.num_experts_per_tok * s.moe_intermediate_size if s.is_moe
           else s.intermediate_size)
    work = batched * (2 * s.hidden_size + 3 * ffn / tp) * 2 + 256 * s.vocab_size * 8
    device = int(0.9 * H20 - s.num_params() * 2 / tp - work)
    share = max(1 / tp, 1 / s.num_kv_heads)
    return device, int(device // (s.kv_bytes_per_token(2) * share))


def test_the_7b_groups_genrm_replica_holds_what_four_h20s_leave(tmp_path):
    """Qwen3-30B-A3B on 4 H20s: 86.4 GiB usable a GPU - 14.2 GiB of weights - 0.6 GiB of
    workspace = 71.6 GiB of KV a GPU, 3.1M tokens a replica (98,304 bytes a token, a
    quarter on each GPU): 7x the 437K tokens the per-replica 40 GiB constant gave."""
    cfg = group("qwen2.5-7b_qwen3-30b-a3b", tmp_path)
    device, tokens = by_hand(cfg, "genrm")
    assert device / GiB == pytest.approx(71.6, abs=0.1)
    assert loop_config(cfg).kv_capacity["reward"] == tokens          # scheduler, live and sim
    assert engine_options(cfg, "genrm").kv_cache_memory_bytes == device   # each TP rank's vLLM
    assert tokens == pytest.approx(3.13e6, rel=0.01) and tokens > 7 * OLD_GENRM_TOKENS
    device, tokens = by_hand(cfg, "policy")   # Qwen2.5-7B on one H20
    assert loop_config(cfg).kv_capacity["rollout"] == tokens == pytest.approx(1.31e6, rel=0.01)
    assert engine_options(cfg, "policy").kv_cache_memory_bytes == device


def test_8_gpu_replicas_of_the_72b_group_get_their_gpus_memory(tmp_path):
    """The 72B group's TP-8 replicas were given 40 GiB / 8 = 5 GiB a GPU; the derivation
    leaves each GPU what its 1/8 of the weights does not take (68 and 57 GiB)."""
    cfg = group("qwen2.5-72b_qwen3.5-122b-a10b", tmp_path)
    for model, gib in (("policy", 68.3), ("genrm", 57.2)):
        got = engine_options(cfg, model).kv_cache_memory_bytes / GiB
        assert got == pytest.approx(gib, abs=0.2)
    assert loop_config(cfg).kv_capacity["rollout"] == by_hand(cfg, "policy")[1]


def test_an_explicit_kv_cache_mb_keeps_its_meaning(tmp_path):
    """roles.kv_cache_mb > 0 (the CPU configs set it) is an override: one replica's MiB,
    split over its TP ranks, as before issue 49."""
    cfg = group("qwen2.5-7b_qwen3-30b-a3b", tmp_path, "roles.kv_cache_mb=40960")
    assert engine_options(cfg, "genrm").kv_cache_memory_bytes == 40960 * 2**20 // 4
    assert loop_config(cfg).kv_capacity["reward"] == OLD_GENRM_TOKENS
    tiny = load_config(ROOT / "configs" / "genrm-heavy-cpu.yaml", check_files=False)
    assert tiny.roles.kv_cache_mb == 48


def test_a_cpu_device_derives_from_the_emulations_own_figure(tmp_path):
    """device_kind cpu, no kv_cache_mb: 0.25 GiB a device (gps/memory.py), the CPU
    adapter's iteration budget (4,096 tokens) for the workspace."""
    from pivotrl_hpc.gps.memory import DEVICE_MEMORY_GIB, KVBudget

    assert DEVICE_MEMORY_GIB == {"gpu": 96.0, "cpu": 0.25}
    cfg = group("qwen2.5-7b_qwen3-30b-a3b", tmp_path, "cluster.device_kind=cpu",
                "cluster.device_memory_gib=200", "models.genrm.expert_parallel=1")
    kv = KVBudget(cfg, "policy")
    assert kv.memory == 200 * GiB and kv.tokens_batched == 2048 + 15360 > 4096
    s = kv.shape
    work = (2048 + 15360) * (2 * s.hidden_size + 3 * s.intermediate_size) * 2 \
        + 256 * s.vocab_size * 8
    assert kv.device_bytes == int(0.9 * 200 * GiB - s.num_params() * 2 - work)


def test_a_model_that_does_not_fit_its_device_is_refused_before_anything_starts(tmp_path):
    """Qwen2.5-7B's 14.2 GiB of weights on a 16 GiB device at 0.9 leave nothing for its KV
    cache: the error names the key and the figures."""
    cfg = group("qwen2.5-7b_qwen3-30b-a3b", tmp_path, "cluster.device_memory_gib=16")
    with pytest.raises(ConfigError) as e:
        check_kv_capacity(cfg)
    msg = str(e.value)
    assert "cluster.device_memory_gib" in msg and "16.00 GiB x 0.9" in msg
    assert "weights 14.19 GiB" in msg and "rollout replica holds 0 tokens" in msg


@pytest.mark.parametrize("key,value,needle", [
    ("roles.gpu_memory_utilization", "0", "must be in (0, 1]"),
    ("roles.gpu_memory_utilization", "1.5", "must be in (0, 1]"),
    ("cluster.device_memory_gib", "-1", "must be >= 0"),
    ("roles.kv_cache_mb", "-5", "must be >= 0")])
def test_bad_memory_settings_are_refused(key, value, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)) as e:
        load_config(ROOT / "configs" / "tiny-cpu.yaml", [f"{key}={value}"], check_files=False)
    assert key in str(e.value)


def test_a_gpu_smaller_than_the_derivation_assumed_is_refused_by_the_engine():
    from pivotrl_hpc.engines.vllm.backend import check_device_memory
    from pivotrl_hpc.protocol.engine import EngineOptions

    opts = EngineOptions(kv_cache_memory_bytes=70 * GiB, device_memory_bytes=96 * GiB)
    check_device_memory(opts, 97 * GiB)
    with pytest.raises(ValueError, match="cluster.device_memory_gib: 79.6"):
        check_device_memory(opts, int(79.6 * GiB))
    check_device_memory(EngineOptions(), 1)   # an explicit KV size: nothing to check
