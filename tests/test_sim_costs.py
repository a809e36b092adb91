"""Costs the simulator charged wrong before issue 49 (sim/profile.py), worked out by hand:
an MoE decode reads only the experts its batch touches, and training pays its
communication, so it does not scale perfectly with width."""
from __future__ import annotations

from pathlib import Path

import pytest

from pivotrl_hpc.assets.cards import CARDS
from pivotrl_hpc.config import load_config
from pivotrl_hpc.gps.shapes import ModelShape
from pivotrl_hpc.sim import profile as pf
from pivotrl_hpc.sim.run import SimConstants
from pivotrl_hpc.sim.standin import stand_in

ROOT = Path(__file__).resolve().parents[1]
H20, MEM = pf.H20, 0.7 * 4.0e12
S30 = ModelShape.from_hf_config(CARDS["Qwen3-30B-A3B"])
S7 = ModelShape.from_hf_config(CARDS["Qwen2.5-7B"])
ROUTED = 128 * 48 * 3 * 2048 * 768        # Qwen3-30B-A3B's routed experts' parameters


def constants(tmp_path, *overrides: str) -> SimConstants:
    cfg, _ = stand_in(load_config(ROOT / "configs" / "qwen2.5-7b_qwen3-30b-a3b.yaml",
                                  list(overrides), check_files=False), tmp_path)
    return SimConstants.from_profile(cfg, H20)


def test_a_lone_judgement_reads_8_of_128_experts_a_layer(tmp_path):
    """The 7B group's GenRM (Qwen3-30B-A3B, TP 4): an iteration of one sequence reads the
    dense 1.5e9 parameters and 1/16 of the routed 29e9; of 10 sequences 1 - (15/16)^10 =
    48 % of them, of 256 all. Before, every iteration read all 30.5e9 (5.45 ms a GPU)."""
    g = constants(tmp_path).throughput["genrm"]
    dense, experts = (S30.num_params() - ROUTED) * 2 / 4 / MEM, ROUTED * 2 / 4 / MEM
    for n, share in ((1, 1 / 16), (10, 1 - (15 / 16) ** 10), (256, 1.0)):
        want = g.A * 5000 + max(dense + experts * share, g.C * n) + g.D
        assert g.latency(n, 5000) == pytest.approx(want, rel=1e-5)
    assert g.latency(1, 5000) < 0.5 * (g.A * 5000 + S30.num_params() * 2 / 4 / MEM + g.D)
    # a 20K judgement decoded alone: ~95 s where reading every expert made it ~200 s
    alone = sum(g.latency(1, 17408 + i) for i in range(20480))
    assert 85 < alone < 105


def test_a_dense_model_still_reads_all_its_weights(tmp_path):
    p = constants(tmp_path).throughput["policy"]
    assert p.latency(1, 0) == pytest.approx(S7.num_params() * 2 / MEM + p.D)
    assert p.latency(1, 0) == p.latency(20, 0)     # weight bound below ~26 sequences


def test_the_moe_model_survives_calibration_and_planner_profiles(tmp_path):
    """The calibration scales expert_B with A-D; a planner profile file (vars of the
    constants, reproduce/runs.py) loads back as the same MoE model."""
    from pivotrl_hpc.config.schema import CalibrationConfig
    from pivotrl_hpc.sched.model import MoEThroughputModel, ThroughputModel

    c = constants(tmp_path)
    g = c.throughput["genrm"]
    scaled = pf.calibrated(c, CalibrationConfig(genrm_scale=2.0)).throughput["genrm"]
    assert isinstance(scaled, MoEThroughputModel)
    assert scaled.latency(3, 100) == pytest.approx(2 * g.latency(3, 100))
    assert ThroughputModel.from_dict(dict(vars(g))) == g
    assert ThroughputModel.from_dict(g.to_dict()) == g
    with pytest.raises(ValueError, match="top_k"):
        MoEThroughputModel(0, 1e-3, 0, 0, expert_B=1e-3, experts=8, top_k=9)


def test_the_modeled_genrm_charges_a_tail_less_than_a_full_batch(tmp_path):
    """The modeled worker times its iterations with the same model: a Step of one
    sequence costs 16 iterations at the one-sequence weight read."""
    from pivotrl_hpc.controller.clock import VirtualClock
    from pivotrl_hpc.protocol.messages import AddSequences, RoleKind, SeqRequest, ShiftUp, Step
    from pivotrl_hpc.sim.modeled import ModeledStore, ModeledWorker

    c = constants(tmp_path)
    g = c.throughput["genrm"]

    def step_seconds(n: int) -> float:
        w = ModeledWorker(0, VirtualClock(), ModeledStore(), dict(c.throughput),
                          {"reward": 0.0}, {"reward": 0.0})
        w._run(ShiftUp(RoleKind.REWARD))
        w._run(AddSequences(tuple(SeqRequest(f"s{i}", (1,) * 100, max_new_tokens=64)
                                  for i in range(n))))
        return w._run(Step(16))[1]

    assert step_seconds(1) == pytest.approx(sum(g.latency(1, 100 + i) for i in range(16)))
    assert step_seconds(1) < 0.5 * step_seconds(128)


def test_training_pays_its_gradient_all_reduce_and_optimizer(tmp_path):
    """7B policy at TP 4: each step all-reduces 4 bytes (fp32 grads) x 7.6e9 / 4 over a
    ring of dp ranks and steps Adam over the rank's whole shard (28 bytes a parameter).
    8 GPUs sit in one node: the ring runs on NVLink; 32 span 4 nodes: on InfiniBand."""
    n = S7.num_params()
    adam = 28 * n / 4 / MEM
    narrow = constants(tmp_path / "a")   # training on 8 GPUs (Table 4)
    assert narrow.train_s == pytest.approx(4 * n / 4 * (2 * 1 / 2) / 900e9 + adam)
    wide = constants(tmp_path / "b", "paradigm.name=colocated")   # all 32
    assert wide.train_s == pytest.approx(4 * n / 4 * (2 * 7 / 8) / 50e9 + adam)
    tp_comm = 6 * 28 * 3584 * 2 * (2 * 3 / 4) / 900e9
    assert wide.train_s_per_token == pytest.approx(
        pf.train_seconds(S7, 1.0, 32, H20) + tp_comm / 8)


def test_training_time_does_not_scale_perfectly_with_width(tmp_path):
    """A step of the calibration's size (512 samples x ~1,300 tokens): 4x the GPUs gives
    less than 4x the speed, and a small batch on 32 GPUs is bound by its all-reduce."""
    def step(c, tokens):
        return c.train_s + c.train_s_per_token * tokens

    narrow = constants(tmp_path / "a")
    wide = constants(tmp_path / "b", "paradigm.name=colocated")
    big, small = 512 * 1300, 8 * 1300
    assert 3.5 < step(narrow, big) / step(wide, big) < 3.99
    assert step(narrow, small) / step(wide, small) < 2.5


def test_dispatch_picks_the_best_replica_under_the_moe_model(tmp_path):
    """The Dispatch index's bucketed arg-max (sched/index.py) uses the model's FFN term at
    n and n + 1, so under the MoE model (weight reads growing with the batch) it finds the
    replica a full scan of ΔT finds."""
    import random

    from pivotrl_hpc.sched.index import DispatchIndex

    g = constants(tmp_path).throughput["genrm"]
    rng = random.Random(0)
    for _ in range(200):
        reps = [(rng.randint(0, 60), rng.randint(0, 400_000)) for _ in range(12)]
        n, t = [r[0] for r in reps], [r[1] for r in reps]
        index = DispatchIndex.from_counts(g, list(n), list(t), [500_000] * 12)
        assert index.best is not index._best_scan     # the bucketed path, as in a run
        length = rng.randint(100, 20_000)
        want = max((g.gain(a, b, length), -i) for i, (a, b) in enumerate(reps)
                   if 500_000 - b >= length)
        assert index.best(length) == -want[1]
