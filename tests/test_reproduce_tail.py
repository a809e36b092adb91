"""`pivotrl reproduce --only tail`: the beyond-the-paper ablation's runs, JSON and summary,
without simulating (the runs' figures are given)."""
from __future__ import annotations

from pathlib import Path

from lever_util import check_ablation

from pivotrl_hpc.reproduce import experiments, paper
from pivotrl_hpc.reproduce.experiments import Lab, Scale
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
    check_ablation(got, made, "tail", f"paradigm.tail_isolation={experiments.TAIL_ISOLATION}",
                   1100.0, tmp_path)


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
