"""`pivotrl reproduce`: the paper's figures from the simulator, ours beside the paper's.

At ~1 % of the paper's lengths (experiments.QUICK) on the smallest group, so the whole file
takes seconds: the numbers are the runs' own, and every derived figure (means, ratios, the
best split) is checked against the runs it came from."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from report_util import check_png

from pivotrl_hpc.reproduce import paper
from pivotrl_hpc.reproduce.experiments import QUICK, Lab
from pivotrl_hpc.reproduce.runs import Run, run_one

ROOT = Path(__file__).resolve().parents[1]
GROUP = "qwen2.5-1.5b_glm-z1-9b"
SCALE = replace(QUICK, seeds=2, table2_gpus=(16,), search=True)
PROCESSED = "processed_tokens_per_s"


@pytest.fixture(scope="module")
def lab():
    lab = Lab(ROOT / "configs", SCALE)
    lab.fig9_result = lab.fig9((GROUP,))
    return lab


def test_paper_ratios_are_the_published_ones():
    """Figure 9's labels (x1.84 x1.61 x1.97 for the 1.5B group, ...) from its bar values."""
    labels = {"qwen2.5-1.5b_glm-z1-9b": (1.84, 1.61, 1.97),
              "qwen2.5-7b_qwen3-30b-a3b": (1.98, 1.95, 1.61),
              "qwen2.5-32b_qwen3-30b-a3b": (2.05, 1.50, 1.81),
              "qwen2.5-72b_qwen3.5-122b-a10b": (1.81, 1.57, 1.66)}
    for g, want in labels.items():
        got = [paper.PAPER_SHIFT_RATIOS[p][g] for p in ("colocated", "disaggregated",
                                                        "rr_colocated")]
        assert got == pytest.approx(want, abs=0.006), g


def test_fig9_means_ratios_and_split_come_from_its_runs(lab):
    from pivotrl_hpc.cli.bench_e2e import candidates

    g = lab.fig9_result[GROUP]
    for p, ours in g["ours"].items():
        assert len(ours["runs"]) == SCALE.seeds
        assert ours[PROCESSED] == pytest.approx(statistics.fmean(ours["runs"]))
        assert ours["std"] == pytest.approx(statistics.pstdev(ours["runs"]))
        bar = paper.FIG9[GROUP].get(p)   # rr_colocated_pooled: ours beside, no bar
        assert ours["over_paper"] == (None if bar is None else pytest.approx(ours[PROCESSED] / bar))
    assert set(g["speedup_vs"]) == {"colocated", "disaggregated", "rr_colocated",
                                    "rr_colocated_pooled"}
    for p, ratio in g["speedup_vs"].items():
        assert ratio == pytest.approx(g["ours"]["shiftable"][PROCESSED] / g["ours"][p][PROCESSED])
        if p == "rr_colocated_pooled":
            assert p not in g["reaches_paper_lower_bound"] and p not in g["paper_speedup_vs"]
            continue
        assert g["reaches_paper_lower_bound"][p] == (ratio >= paper.FIG9_RANGES[p][0])
        assert g["paper_speedup_vs"][p] == pytest.approx(paper.PAPER_SHIFT_RATIOS[p][GROUP])
    assert g["shiftable_beats_every_baseline"] == all(v > 1 for v in g["speedup_vs"].values())
    # the disaggregated split is the best of the search's candidates on seed 0
    ns = argparse.Namespace(config=lab.config(GROUP), overrides=list(SCALE.overrides))
    options = candidates(ns, "disaggregated", check_files=False)
    assert len(options) > 1 and g["ours"]["disaggregated"]["split"] in options
    seed0 = {tuple(x): run_one(lab.run(GROUP, "disaggregated", 0, x)).figures[PROCESSED]
             for x in options}
    assert g["ours"]["disaggregated"]["runs"][0] == max(seed0.values())
    assert seed0[tuple(g["ours"]["disaggregated"]["split"])] == max(seed0.values())


def test_a_run_is_deterministic_and_its_seed_matters():
    r = Run(str(ROOT / "configs" / f"{GROUP}.yaml"), "shiftable", 0,
            (*SCALE.overrides, "rl.steps=1"))
    a, b, c = run_one(r), run_one(r), run_one(replace(r, seed=1))
    assert a.figures == b.figures
    assert c.figures["tokens_per_s"] != a.figures["tokens_per_s"]


def test_fig11_ratios_are_over_fig9s_disaggregated(lab):
    out = lab.fig11((GROUP,))[GROUP]
    base = out["disaggregated_tokens_per_s"]
    assert base == pytest.approx(lab.fig9_result[GROUP]["ours"]["disaggregated"][PROCESSED])
    for p, ratio in out["over_disaggregated"].items():
        assert ratio == pytest.approx(statistics.fmean(out["tokens_per_s"][p]) / base), p
    assert out["paper_over_disaggregated"] == paper.FIG11[GROUP]
    r = out["over_disaggregated"]
    assert out["component_order_as_paper"] == (r["vanilla"] <= r["vanilla_tm"]
                                               <= r["shiftable"])


def test_fig3_fractions_are_fractions_of_every_role_held(lab):
    fr = lab.fig3(GROUP)["fraction_below_low"]
    assert set(fr) == {"colocated", "disaggregated", "rr_colocated", "shiftable"}
    for p, roles in fr.items():
        assert all(v is None or 0.0 <= v <= 1.0 for v in roles.values()), (p, roles)
        assert roles["rollout"] is not None and roles["training"] is not None, (p, roles)


def test_fig13_replication_is_the_gps_plans_by_hand():
    """Qwen2.5-7B in bf16 (15,231,233,024 bytes) written from one node (training TP=4) over
    50 GB/s IB, 20 us a transfer. The star plan of before: the writer sends each other node
    its copy, (nodes - 1) x (bytes / IB + 20 us). The chain: pieces of c bytes go down the
    nodes, (pieces + nodes - 2) piece times, flat within 1.5x from 16 to 1024 GPUs. The
    shift seconds are the profile's, whatever the GPU count."""
    from pivotrl_hpc.gps.plan import MAX_CHUNKS, chunk_size, LinkModel
    from pivotrl_hpc.sim.profile import H20

    fig = Lab(ROOT / "configs", SCALE).fig13()
    rows, size = fig["rows"], 15_231_233_024
    links = LinkModel(local_bps=H20.pcie_bps, remote_bps=H20.ib_bps)
    for r in rows:
        others = r["nodes"] - 1
        assert r["write_replication_star_bytes"] == r["write_replication_bytes"] == others * size
        assert r["write_replication_star_s"] == pytest.approx(
            others * (size / H20.ib_bps + 20e-6))
        c = chunk_size(size, others, links)
        pieces = -(-size // c)
        assert pieces <= MAX_CHUNKS
        if size % c == 0:   # every piece of one size: the pipeline's figure exactly
            assert r["write_replication_s"] == pytest.approx(
                (pieces + others - 1) * (c / H20.ib_bps + 20e-6))
        assert size / H20.ib_bps < r["write_replication_s"] < 1.3 * size / H20.ib_bps
        assert r["rollout"] == rows[0]["rollout"] and r["reward"] == rows[0]["reward"]
    assert [r["nodes"] for r in rows] == [2, 4, 8, 16, 32, 64, 128]
    assert rows[-1]["write_replication_star_s"] > 38     # 127 copies from the writer
    assert fig["write_replication_growth"] == pytest.approx(
        rows[-1]["write_replication_s"] / rows[0]["write_replication_s"])
    assert fig["write_replication_growth"] < 1.5         # flat to 1024 GPUs
    assert rows[0]["rollout"][0] == pytest.approx(H20.engine_wake_s + size / H20.pcie_bps)


def test_pivotrl_reproduce_writes_json_and_pngs(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "reproduce", "--quick",
                        "--only", "table2,fig13,fig14", "--seeds", "1", "--jobs", "2",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Figure 14" in p.stdout and "Table 2" in p.stdout
    everything = json.loads((tmp_path / "reproduce.json").read_text())
    assert everything["settings"]["seeds"] == 1 and set(everything) >= {"fig14", "table2"}
    fig14 = json.loads((tmp_path / "fig14.json").read_text())
    assert [pt["H"] for pt in fig14["points"]] == list(QUICK.h_values)
    assert all(pt["tokens_per_s"] > 0 and pt["std"] == 0.0 for pt in fig14["points"])
    rows = json.loads((tmp_path / "table2.json").read_text())["rows"]
    assert [r["gpus"] for r in rows] == list(QUICK.table2_gpus)
    assert all(r["total_s"] > 0 and r["candidates"] > 0 for r in rows)
    assert len(json.loads((tmp_path / "fig13.json").read_text())["rows"]) == 7
    for name in ("fig13.png", "fig14.png", "table2.png"):
        check_png(tmp_path / name)


def test_reproduce_refuses_an_unknown_figure(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "reproduce", "--only",
                        "fig99", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "unknown figure(s) fig99" in p.stderr


def test_fig10_allocation_shape_by_hand():
    """The paper's labelled allocations (Figure 10): reward holds >= 16 of 32 GPUs at 19 of
    20 labels, training is up at 3; a timed series weighs each row by its duration."""
    from pivotrl_hpc.reproduce.experiments import allocation_shape

    shape = allocation_shape(paper.FIG10_SHIFTABLE)
    assert shape == {"reward_half_or_more": 0.95, "training_up": 0.15, "rollout_max": 32,
                     "reward_max": 32}
    # as labelled: two labels hold 24 (8 GPUs between roles, mid-shift)
    assert [sum(r[1:]) for r in paper.FIG10_SHIFTABLE].count(32) == 18
    timed = allocation_shape([[0.0, 32, 0, 0], [10.0, 8, 24, 0], [40.0, 0, 24, 8],
                              [50.0, 16, 16, 0]], end=60.0)
    assert timed == {"reward_half_or_more": pytest.approx(50 / 60),
                     "training_up": pytest.approx(10 / 60), "rollout_max": 32,
                     "reward_max": 24}


def test_the_fixed_planner_never_refits_and_keeps_the_configured_tau(tmp_path, monkeypatch):
    """`beyond`'s paper planner: its throughput model is the profile written for it (the
    hardware's own constants, or the uncalibrated datasheet's) and never refitted, its
    tau_shift the configured shift seconds; the online run differs from it."""
    import yaml

    from pivotrl_hpc.controller import live
    from pivotrl_hpc.reproduce.runs import planner_profile
    from pivotrl_hpc.sim.run import SimConstants

    built = []
    real = live.build_controller

    def spy(cfg, *a, **k):
        ctl = real(cfg, *a, **k)
        built.append((cfg, ctl))
        return ctl
    monkeypatch.setattr(live, "build_controller", spy)
    monkeypatch.setattr("pivotrl_hpc.sim.run.build_controller", spy)
    base = Run(str(ROOT / "configs" / f"{GROUP}.yaml"), "shiftable", 0,
               (*SCALE.overrides, "rl.steps=1"))
    fixed = replace(base, overrides=(*base.overrides, "paradigm.measured_tau=false"),
                    planner_profile="exact")
    online, paper_planner = run_one(base), run_one(fixed)
    (cfg0, ctl0), (cfg1, ctl1) = built
    assert not any(m.fixed for m in ctl0.models.values())
    assert all(m.fixed and m.last is None for m in ctl1.models.values())   # never refitted
    assert ctl1.policy.params.tau_shift == {"rollout": cfg1.paradigm.shift_seconds_rollout,
                                            "reward": cfg1.paradigm.shift_seconds_reward,
                                            "training": cfg1.paradigm.shift_seconds_training}
    assert ctl0.policy.params.tau_shift is ctl0.tau.tau   # the online one tracks the shifts
    assert online.figures != paper_planner.figures
    # the profile file holds the constants it is named for
    exact = SimConstants({"rollout": 1.0}, {"rollout": 1.0}, 0.0,
                         {"policy": ctl1.models["rollout"].model,
                          "genrm": ctl1.models["reward"].model})
    path = planner_profile("exact", exact, None, tmp_path)
    assert yaml.safe_load(path.read_text())["policy"] == vars(ctl1.models["rollout"].model)
    with pytest.raises(ValueError, match="planner profile 'measured'"):
        planner_profile("measured", exact, exact, tmp_path)
