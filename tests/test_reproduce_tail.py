"""`pivotrl reproduce --only tail`: the beyond-the-paper ablation's runs, JSON and summary,
without simulating (the runs' figures are given)."""
from __future__ import annotations

from pathlib import Path

from pivotrl_hpc.cli.reproduce import summary
from pivotrl_hpc.reproduce import experiments, paper
from pivotrl_hpc.reproduce.experiments import Lab, Scale
from pivotrl_hpc.reproduce.plots import PLOTS
from pivotrl_hpc.reproduce.runs import Outcome

ROOT = Path(__file__).resolve().parents[1]


def fake_lab(monkeypatch, made: list) -> Lab:
    lab = Lab(ROOT / "configs", Scale(steps=2, seeds=2))

    def run_all(runs):
        made.extend(runs)
        tail = [r for r in runs if any("tail_isolation" in o for o in r.overrides)]
        return [Outcome(r, {"processed_tokens_per_s": 1100.0 + r.seed if r in tail
                            else 1000.0 + r.seed}) for r in runs]
    monkeypatch.setattr(lab, "_all", run_all)
    return lab


def test_each_group_runs_pivotrl_as_the_paper_and_with_the_lever_on_the_same_seeds(
        monkeypatch, tmp_path):
    made: list = []
    got = fake_lab(monkeypatch, made).tail()
    assert len(made) == 2 * 2 * len(paper.GROUPS)
    lever = f"paradigm.tail_isolation={experiments.TAIL_ISOLATION}"
    for g in paper.GROUPS:
        runs = [r for r in made if r.tag == g]
        assert {r.paradigm for r in runs} == {"shiftable"}
        assert sorted((r.seed, lever in r.overrides) for r in runs) == [
            (0, False), (0, True), (1, False), (1, True)]
        row = got["groups"][g]
        assert row["paper"] == [1000.0, 1001.0] and row["tail"] == [1100.0, 1101.0]
        assert abs(row["ratio"] - 1100.5 / 1000.5) < 1e-12
    assert got["reaches_goal_everywhere"] is True and got["lever"] == lever
    assert "1000 -> 1100 1.100x" in summary({"tail": got}, tmp_path)
    assert PLOTS["tail"](got, tmp_path / "tail.png").stat().st_size > 0


def test_pivotrl_as_the_paper_is_fig9s_shiftable_when_fig9_ran(monkeypatch):
    made: list = []
    lab = fake_lab(monkeypatch, made)
    g = paper.GROUPS[0]
    lab.fig9_runs[(g, "shiftable")] = [{"processed_tokens_per_s": 900.0},
                                       {"processed_tokens_per_s": 950.0}]
    got = lab.tail((g,))
    assert all(any("tail_isolation" in o for o in r.overrides) for r in made)
    assert got["groups"][g]["paper"] == [900.0, 950.0]
    assert got["reaches_goal_everywhere"] is True
