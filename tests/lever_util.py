"""Shared checks of `pivotrl reproduce`'s beyond-the-paper ablations (`--only tail`,
`--only partial`): the runs' figures are given, nothing is simulated."""
from __future__ import annotations

from pathlib import Path

from pivotrl_hpc.cli.reproduce import summary
from pivotrl_hpc.reproduce import paper
from pivotrl_hpc.reproduce.plots import PLOTS


def check_ablation(got: dict, made: list, name: str, lever: str, on: float,
                   tmp_path: Path) -> None:
    """Per group, shiftable on seeds 0-1 with and without `lever`, the runs' figures 1000 +
    seed without it and `on` + seed with it; the ratio, the JSON, summary line and plot."""
    assert len(made) == 2 * 2 * len(paper.GROUPS)
    for g in paper.GROUPS:
        runs = [r for r in made if r.tag == g]
        assert {r.paradigm for r in runs} == {"shiftable"}
        assert sorted((r.seed, lever in r.overrides) for r in runs) == [
            (0, False), (0, True), (1, False), (1, True)]
        row = got["groups"][g]
        assert row["paper"] == [1000.0, 1001.0] and row[name] == [on, on + 1]
        assert abs(row["ratio"] - (on + 0.5) / 1000.5) < 1e-12
    assert got["reaches_goal_everywhere"] is True and got["lever"] == lever
    assert f"1000 -> {on:.0f} {on / 1000:.3f}x" in summary({name: got}, tmp_path)
    assert PLOTS[name](got, tmp_path / f"{name}.png").stat().st_size > 0
