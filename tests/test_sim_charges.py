"""The simulator's charges beside decode and shifts (sim/costs.py, issue 49): the GPS Write
of each published step, the rollout Reload of it and a planner's decision time, each
charged as zero before."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pivotrl_hpc.config import load_config
from pivotrl_hpc.gps.shapes import ModelShape
from pivotrl_hpc.sim.costs import PAPER_TABLE2, gps_costs, planning_seconds
from pivotrl_hpc.sim.profile import H20, replication
from pivotrl_hpc.sim.run import SimConstants, simulate
from pivotrl_hpc.sim.standin import stand_in
from pivotrl_hpc.trace import open_trace

ROOT = Path(__file__).resolve().parents[1]
GROUP = ROOT / "configs" / "qwen2.5-7b_qwen3-30b-a3b.yaml"
SHORT = ["rl.steps=3", "rl.batch_size=2", "rl.group_size=4", "workload.rollout_median=300",
         "workload.genrm_median=200"]


def _group(tmp_path: Path, *overrides: str):
    cfg, _ = stand_in(load_config(GROUP, [*SHORT, *overrides], check_files=False), tmp_path)
    return cfg


def test_write_and_reload_seconds_by_hand(tmp_path):
    """Qwen2.5-7B in bf16 on the paper's cluster (4 nodes of 8 H20): DP rank 0's 4 TP ranks
    each copy a quarter over PCIe; the chain replicates the whole to the 3 other nodes over
    IB (the model Figure 13 reports); a TP=1 rollout replica Reads it all over PCIe."""
    cfg = _group(tmp_path)
    shape = ModelShape.from_hf_config(cfg.models.policy.path)
    nbytes = shape.num_params() * 2
    got = gps_costs(cfg, shape, H20)
    assert got["write_local_s"] == pytest.approx(nbytes / 4 / 63e9)
    assert got["write_replication_s"] == pytest.approx(
        replication(nbytes, 4, 1, H20)["write_replication_s"])
    assert got["write_replication_s"] >= 3 * nbytes / 50e9 / 3   # at least one IB copy
    assert got["reload_s"] == pytest.approx(nbytes / 63e9) and got["reload_s"] > 0.2
    c = SimConstants.from_profile(cfg, H20)
    assert (c.write_local_s, c.write_replication_s, c.reload_s) == pytest.approx(
        (got["write_local_s"], got["write_replication_s"], got["reload_s"]))


def test_planning_seconds_are_table_2s(tmp_path):
    assert planning_seconds(16) == PAPER_TABLE2["qwen2.5-1.5b_glm-z1-9b"][16]
    assert planning_seconds(32) == pytest.approx((0.74 + 0.55) / 2)
    assert planning_seconds(96) == pytest.approx(((1.71 + 1.16) / 2 + (2.95 + 2.81) / 2) / 2)
    assert planning_seconds(1024) == planning_seconds(128) == pytest.approx(2.88)
    assert SimConstants.from_profile(_group(tmp_path), H20).planning_s == planning_seconds(32)


def test_a_published_step_reaches_rollout_after_its_write_and_reload(tmp_path):
    """Every rollout Reload takes reload_s, and a step's version reaches a rollout replica
    no sooner than write_local_s + write_replication_s + reload_s after its training
    ended (disaggregated: rollout is up throughout)."""
    cfg = _group(tmp_path, "paradigm.name=disaggregated")
    c = replace(SimConstants.from_profile(cfg, H20), planning_s=0.0)
    path = tmp_path / "dis.h5"
    simulate(cfg, c, path)
    with open_trace(str(path)) as t:
        steps, reloads = t.table("steps"), t.table("reloads")
    assert len(reloads["t"]) > 0
    assert list(reloads["seconds"]) == pytest.approx([c.reload_s] * len(reloads["t"]))
    for end, seconds, version in zip(steps["t"], steps["seconds"], steps["version"]):
        first = min(t for t, v in zip(reloads["t"], reloads["version"]) if v == version)
        # steps.t is the TrainStep's reply: the Write's local part is in it already
        assert first - end >= c.write_replication_s + c.reload_s - 1e-9
        assert seconds >= c.write_local_s


@pytest.mark.parametrize("paradigm, charged", [("shiftable", True), ("disaggregated", False)])
def test_a_planners_plan_is_executed_its_decision_seconds_after_its_snapshot(
        tmp_path, paradigm, charged):
    """Every decision of the planner is made on a snapshot `planning_s` old (its trace row
    is written when it is executed); a fixed policy's decision costs nothing."""
    cfg = _group(tmp_path, f"paradigm.name={paradigm}")
    c = replace(SimConstants.from_profile(cfg, H20), planning_s=2.5)
    path = tmp_path / f"{paradigm}.h5"
    simulate(cfg, c, path)
    with open_trace(str(path)) as t:
        rows = t.table("planner")
    decided = [(float(t), json.loads(s)["time"] if isinstance(s, str) else s["time"], d)
               for t, s, d, r in zip(rows["t"], rows["snapshot"], rows["decision_s"],
                                     rows["reason"]) if r != "initial allocation"]
    assert len(decided) > 3
    want = 2.5 if charged else 0.0
    for t, snap_t, seconds in decided:
        assert t - snap_t == pytest.approx(want, abs=1e-9)
        if charged:
            assert seconds == 2.5
