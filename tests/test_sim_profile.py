"""Device profiles derived from the hardware and the models' dimensions (sim/profile.py): the
constants of each paper group, checked against numbers worked out by hand from the H20's
datasheet and the models' published configs."""
from __future__ import annotations

from pathlib import Path

import pytest

from pivotrl_hpc.assets.cards import CARDS
from pivotrl_hpc.gps.shapes import ModelShape
from pivotrl_hpc.sim import profile as pf

ROOT = Path(__file__).resolve().parents[1]
GROUPS = sorted(p.name for p in (ROOT / "configs").glob("qwen*.yaml"))
H20 = pf.H20
MEM, FLOPS = 0.7 * 4.0e12, 0.5 * 148e12   # the assumed achieved HBM bytes/s and FLOP/s


def shape(name: str) -> ModelShape:
    return ModelShape.from_hf_config(CARDS[name])


def test_dense_model_constants_by_hand():
    """Qwen2.5-7B, bf16, TP=1: 7.62e9 params; KV per token 28 layers x 2 x 4 heads x 128 x
    2 bytes = 57,344 bytes."""
    s = shape("Qwen2.5-7B")
    m = pf.inference_model(s, "bfloat16", 1, H20)
    assert m.A == pytest.approx(57344 / MEM)
    assert m.B == pytest.approx(s.num_params() * 2 / MEM)
    assert m.B == pytest.approx(5.44e-3, rel=0.01)           # 15.2 GB at 2.8 TB/s
    assert m.C == pytest.approx(2 * s.num_params() / FLOPS)
    assert m.D == pytest.approx(3e-3)                          # TP=1: no all-reduce
    # ~26 sequences before the FFN turns compute bound (B = C n)
    assert 20 < m.B / m.C < 40


def test_moe_model_reads_the_experts_a_batch_touches_but_computes_top_k():
    """Qwen3-30B-A3B at TP=4: B reads the dense 1.5e9 params / 4 and expert_B the routed
    29e9 (128 experts x 48 layers x 3 x 2048 x 768) / 4, of which a batch of n reads the
    expected distinct share 1 - (1 - 8/128)^n; C counts the 3.3e9 active ones; its 4 KV
    heads are split 4 ways; D adds 2 all-reduces in each of 48 layers."""
    s = shape("Qwen3-30B-A3B")
    m = pf.inference_model(s, "bfloat16", 4, H20)
    routed = 128 * 48 * 3 * 2048 * 768
    assert s.num_active_params() == pytest.approx(3.35e9, rel=0.02)
    assert m.expert_B == pytest.approx(routed * 2 / 4 / MEM)
    assert m.B == pytest.approx((s.num_params() - routed) * 2 / 4 / MEM)
    assert (m.experts, m.top_k) == (128, 8)
    assert m.weight_seconds(1) == pytest.approx(m.B + m.expert_B / 16)
    assert m.weight_seconds(10) == pytest.approx(m.B + m.expert_B * (1 - (15 / 16) ** 10))
    assert m.weight_seconds(256) == pytest.approx(m.B + m.expert_B, rel=1e-6)
    assert m.C == pytest.approx(2 * s.num_active_params() / 4 / FLOPS)
    assert m.A == pytest.approx(s.kv_bytes_per_token(2) / 4 / MEM)
    assert m.D == pytest.approx(3e-3 + 96 * 10e-6)


def test_kv_heads_are_replicated_beyond_their_count():
    """GLM-Z1-9B has 2 KV heads: at TP=4 each GPU keeps half of each token's KV, not a
    quarter."""
    s = shape("GLM-Z1-9B")
    assert pf.inference_model(s, "bfloat16", 4, H20).A == pytest.approx(
        s.kv_bytes_per_token(2) / 2 / MEM)


def test_shift_seconds_by_hand_and_against_figure_12():
    s7, s122 = shape("Qwen2.5-7B"), shape("Qwen3.5-122B-A10B")
    up, down = pf.inference_shift(s7, "bfloat16", 1, H20)
    assert up == pytest.approx(1.0 + s7.num_params() * 2 / 63e9) and down == 0.5
    up122, _ = pf.inference_shift(s122, "bfloat16", 4, H20)
    assert up122 > up                                   # bigger models shift up slower
    t_up, t_down = pf.training_shift(s7, 8, 4, H20)
    states = 12 * s7.num_params() / 8 / 63e9
    assert t_up == pytest.approx(1.5 + 2 * s7.num_params() / 4 / 63e9 + states)
    assert t_down == pytest.approx(1.0 + states)
    # the derivation stays inside the ranges the paper measured (Figure 12)
    lo, hi = pf.PAPER_SHIFTS["inference_up"]
    assert 0.5 * lo <= up <= up122 <= hi
    assert t_down <= pf.PAPER_SHIFTS["training_down_max"]


def test_training_seconds_by_hand():
    """8 N tokens / (GPUs x FLOP/s x MFU): one 7B step of 512 samples x 4,000 tokens on 8
    H20s at 35 % MFU is about 6 minutes."""
    s = shape("Qwen2.5-7B")
    t = pf.train_seconds(s, 512 * 4000, 8, H20)
    assert t == pytest.approx(8 * s.num_params() * 512 * 4000 / (8 * 148e12 * 0.35))
    assert 300 < t < 420


@pytest.mark.parametrize("group", GROUPS)
def test_each_paper_group_gets_its_own_constants(group, tmp_path):
    from pivotrl_hpc.config import load_config
    from pivotrl_hpc.sim.run import SimConstants
    from pivotrl_hpc.sim.standin import stand_in

    cfg, _ = stand_in(load_config(ROOT / "configs" / group, check_files=False), tmp_path)
    c = SimConstants.from_profile(cfg, H20)
    assert c.source == "profile H20-96GB"
    pol = ModelShape.from_hf_config(cfg.models.policy.path)
    expect = pf.inference_model(pol, "bfloat16", cfg.models.policy.tensor_parallel, H20)
    assert c.throughput["policy"] == expect
    step_s, token_s = pf.train_costs(pol, cfg.roles.train_devices,
                                     cfg.roles.train_tensor_parallel,
                                     cfg.cluster.devices_per_node, H20)
    assert (c.train_s, c.train_s_per_token) == pytest.approx((step_s, token_s))
    assert c.train_s > 0   # the step's gradient all-reduce and Adam
    assert set(c.shift_up_s) == {"rollout", "reward", "training"}


def test_the_groups_differ_as_their_models_do(tmp_path):
    """The 72B policy decodes slower than the 1.5B one (B: weights read per token) and trains
    slower per token."""
    from pivotrl_hpc.config import load_config
    from pivotrl_hpc.sim.run import SimConstants
    from pivotrl_hpc.sim.standin import stand_in

    got = {}
    for group in GROUPS:
        cfg, _ = stand_in(load_config(ROOT / "configs" / group, check_files=False),
                          tmp_path / group)
        got[group] = SimConstants.from_profile(cfg, H20)
    small, big = got["qwen2.5-1.5b_glm-z1-9b.yaml"], got["qwen2.5-72b_qwen3.5-122b-a10b.yaml"]
    assert big.throughput["policy"].B > 5 * small.throughput["policy"].B
    assert big.train_s_per_token > 10 * small.train_s_per_token
    assert len({c.throughput["genrm"] for c in got.values()}) == 3   # two groups share one


def test_modeled_training_time_grows_with_the_batch_tokens():
    from pivotrl_hpc.controller.clock import VirtualClock
    from pivotrl_hpc.protocol.messages import TrainBatch, TrainStep
    from pivotrl_hpc.sched.model import ThroughputModel
    from pivotrl_hpc.sim.modeled import ModeledStore, ModeledWorker

    w = ModeledWorker(0, VirtualClock(), ModeledStore(), {"policy": ThroughputModel(0, 1, 0, 0)},
                      {}, {}, train_s=2.0, train_s_per_token=0.01)
    batch = TrainBatch(((1, 2, 3),), ((4, 5, 6, 7),), ((0.0,) * 4,), (1.0,), (0,))
    _, seconds = w._run(TrainStep(batch))
    assert seconds == pytest.approx(2.0 + 0.01 * 7)


def test_simulate_derives_constants_for_gpus_and_reads_them_for_cpus(tmp_path):
    """`pivotrl simulate`: a GPU config gets the H20 profile unless `--hardware config`; a CPU
    config (tiny-cpu, emulated devices) keeps its own constants."""
    import argparse

    from pivotrl_hpc.cli.simulate import _constants
    from pivotrl_hpc.config import load_config
    from pivotrl_hpc.sim.standin import stand_in

    def args(hardware=None):
        return argparse.Namespace(from_trace=None, hardware=hardware, train_seconds=2.0)

    gpu, _ = stand_in(load_config(ROOT / "configs" / GROUPS[0], check_files=False), tmp_path)
    # the paper configs include their calibration, which scales the profile's constants
    assert _constants(args(), gpu).source == "profile H20-96GB, calibrated"
    cfg_c = _constants(args("config"), gpu)
    assert cfg_c.source == "config" and cfg_c.train_s == 2.0
    cpu = load_config(ROOT / "configs" / "tiny-cpu.yaml", check_files=False)
    assert _constants(args(), cpu).source == "config"


def test_training_seconds_follow_each_runs_width(tmp_path, capsys):
    """`pivotrl simulate` of the 7B group (one short step): training seconds per token
    fall with roles.train_devices 4, 8, 16 exactly as 1/width (compute and the TP
    all-reduces of each DP rank's share), a step's do not (its gradient all-reduce), and
    colocated, which trains on all 32 GPUs, is charged a 32-GPU width's seconds."""
    import json

    from pivotrl_hpc.cli.main import main

    group = ROOT / "configs" / "qwen2.5-7b_qwen3-30b-a3b.yaml"
    short = ["rl.steps=1", "rl.batch_size=2", "rl.group_size=4", "workload.rollout_median=25",
             "workload.genrm_median=15"]
    runs = {}
    for width in (4, 8, 16):
        assert main(["simulate", str(group), "--paradigms", "colocated,shiftable",
                     "--no-search", *short, f"roles.train_devices={width}"]) == 0
        runs[width] = json.loads(capsys.readouterr().out)
    per_token = {w: r["shiftable"]["train_s_per_token"] for w, r in runs.items()}
    step = {w: r["shiftable"]["train_step_s"] for w, r in runs.items()}
    assert per_token[4] == pytest.approx(2 * per_token[8]) == pytest.approx(4 * per_token[16])
    # 8 samples a step: too little compute to hide communication. Width 16 spans two nodes,
    # so its gradient all-reduce crosses InfiniBand and the step is slower than at 8
    assert step[16] > step[8] > 0 and step[4] > 0
    s7 = shape("Qwen2.5-7B")
    from pivotrl_hpc.config import load_config
    scale = load_config(group, check_files=False).calibration.train_scale  # its calibration
    for r in runs.values():   # colocated: every device trains, whatever the base width
        assert r["colocated"]["train_s_per_token"] == pytest.approx(
            scale * pf.train_costs(s7, 32, 4, 8, H20)[1])
    assert per_token[8] == pytest.approx(scale * pf.train_costs(s7, 8, 4, 8, H20)[1])
