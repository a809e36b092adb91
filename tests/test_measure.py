"""Figure 9's measurement protocol (sim/measure.py): generated tokens between the ends of
steps FILL_STEPS and RUN_STEPS - DRAIN_STEPS, the same in `pivotrl reproduce` and
`pivotrl simulate`; and what `pivotrl reproduce` prints of it, ours beside the paper's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pivotrl_hpc.reproduce.runs import Run, run_one
from pivotrl_hpc.reproduce.tables import fig9_lines
from pivotrl_hpc.sim import measure

ROOT = Path(__file__).resolve().parents[1]
G7 = "qwen2.5-7b_qwen3-30b-a3b"
SHORT = ("workload.rollout_median=25", "workload.genrm_median=15",   # ~1 % of the lengths
         "rl.batch_size=8")


def _marks() -> list[list[float]]:
    """8 steps: the start-up and the fill (steps 1-2) slow, 4 steady steps of 100 s at
    1,000 tokens/s, the drain (steps 7-8) generating nothing while training ends."""
    t, g, out = 0.0, 0, []
    for dt, tokens in ((300, 60_000), (150, 90_000), *([(100, 100_000)] * 4), (40, 0),
                       (40, 0)):
        t, g = t + dt, g + tokens
        out.append([t, g])
    return out


def test_the_window_leaves_out_the_fill_and_the_drain():
    marks = _marks()
    w = measure.window(marks)
    assert (measure.RUN_STEPS, measure.FILL_STEPS, measure.DRAIN_STEPS) == (8, 2, 2)
    assert (w.first_step, w.last_step) == (2, 6)
    assert (w.t0, w.t1, w.tokens) == (450.0, 850.0, 400_000)
    assert w.tokens_per_s == 1000.0   # the steady steps' rate, exactly
    whole = marks[-1][1] / marks[-1][0]   # the whole run's: 550,000 tokens over 930 s
    assert whole == pytest.approx(591.4, abs=0.1)
    assert measure.processed_tokens_per_s({"step_marks": marks}) == 1000.0


def test_a_run_too_short_for_the_window_is_counted_from_its_start():
    marks = _marks()[:4]   # 4 steps <= fill + drain
    w = measure.window(marks)
    assert (w.first_step, w.last_step, w.t0, w.t1, w.tokens) == (0, 4, 0.0, 650.0, 350_000)
    assert measure.window([]) is None
    # a summary without marks (a trace from before them): the whole run's generated tokens
    assert measure.processed_tokens_per_s({"role_tokens_per_s": {"rollout": 3.0,
                                                                 "reward": 4.0}}) == 7.0


def test_simulate_and_reproduce_measure_a_paper_group_alike():
    """`pivotrl simulate <paper config>` runs the protocol's steps on Table 4's splits with
    the calibration, and its processed tokens/s and speed-ups are reproduce's runs' own."""
    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "simulate",
                        str(ROOT / "configs" / f"{G7}.yaml"), "--paradigms",
                        "colocated,shiftable", *SHORT], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    ours = {}
    for name in ("colocated", "shiftable"):
        run = run_one(Run(str(ROOT / "configs" / f"{G7}.yaml"), name, 0,
                          (*SHORT, f"rl.steps={measure.RUN_STEPS}")))
        ours[name] = run.figures["processed_tokens_per_s"]
        assert out[name]["split"] == []   # the config's (Table 4's) split, unsearched
        assert out[name]["window"]["first_step"] == measure.FILL_STEPS
        assert out[name]["window"]["last_step"] == measure.RUN_STEPS - measure.DRAIN_STEPS
        assert out[name]["processed_tokens_per_s"] == pytest.approx(ours[name], rel=1e-9)
        # the window is not the whole run: start-up, fill and drain are left out
        assert run.figures["whole_run_tokens_per_s"] != pytest.approx(ours[name], rel=1e-3)
    assert out["speedup_vs"]["colocated"] == pytest.approx(ours["shiftable"] / ours["colocated"])
    assert out["constants"]["source"] == "profile H20-96GB, calibrated"


def test_reproduce_prints_ours_beside_the_papers_bars_and_ratios():
    g = {"title": "Qwen2.5-7B & Qwen3-30B-A3B",
         "ours": {"colocated": {"processed_tokens_per_s": 10390.5},
                  "shiftable": {"processed_tokens_per_s": 22822.0},
                  "rr_colocated_pooled": {"processed_tokens_per_s": 15000.0}},
         "paper_tokens_per_s": {"colocated": 11545, "shiftable": 22822},
         "speedup_vs": {"colocated": 22822.0 / 10390.5, "rr_colocated_pooled": 1.52},
         "paper_speedup_vs": {"colocated": 22822 / 11545}}
    lines = fig9_lines(g)
    assert "steps 2 and 6" in lines[0]
    row = {ln.split()[0] if "/" not in ln else " ".join(ln.split()[:3]): ln.split()[-3:]
           for ln in lines[2:]}
    assert row["colocated"] == ["10390", "11545", "0.90"]
    assert row["shiftable"] == ["22822", "22822", "1.00"]
    assert row["rr_colocated_pooled"] == ["15000", "-", "-"]   # no bar of the paper's
    assert row["shiftable / colocated"] == ["2.20x", "1.98x", "1.11"]
    assert row["shiftable / rr_colocated_pooled"] == ["1.52x", "-", "-"]
