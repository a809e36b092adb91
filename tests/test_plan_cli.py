"""`pivotrl plan`, `pivotrl bench planner` and `pivotrl bench dispatch`."""
from __future__ import annotations

import json
from pathlib import Path

from pivotrl_hpc.cli.main import main

FIG8 = Path(__file__).resolve().parents[1] / "examples" / "figure8_snapshot.json"


def test_plan_json_reports_all_five_steps(capsys):
    assert main(["plan", str(FIG8), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shift_up_role"]["role"] == "reward"
    assert set(out["shift_up_role"]["tau"]) == {"rollout", "reward"}
    assert [round(p["penalty"]) for p in out["shift_pairs"]] == [0, 706, 1843]
    assert [c["shift_up_count"] for c in out["candidates"]] == [1, 2, 3, 4]
    for c in out["candidates"]:
        assert {"shift_up_count", "penalty", "est_throughput", "benefit"} <= set(c)
    assert len(out["plan"]["shift_up"]) == 3


def test_plan_table_and_overrides(capsys):
    assert main(["plan", str(FIG8), "--horizon", "0.5"]) == 0
    text = capsys.readouterr().out
    assert "1. shift-up role: reward" in text and "phi=706.0" in text
    # half a second of gain no longer pays for 706 forgone rollout tokens: only the free
    # training GPUs are taken
    assert "5. plan: shift down [training] -> shift up [reward@24-27, reward@28-31]" in text
    assert main(["plan", str(FIG8), "--tau-shift", "rollout=0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["penalty"] for p in out["shift_pairs"]] == [0.0, 0.0, 0.0]
    assert main(["plan", str(FIG8), "--horizon", "0"]) == 0
    assert "5. plan: none (no candidate has a positive benefit" in capsys.readouterr().out


def test_plan_other_policy(capsys):
    assert main(["plan", str(FIG8), "--policy", "static", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "static" and out["plan"]["shift_down"] == ["training"]
    assert main(["plan", str(FIG8), "--policy", "disaggregated", "--param", "rollout_gpus=8",
                 "--param", "reward_gpus=16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {s["role"] for s in out["plan"]["shift_up"]} == {"rollout", "reward"}
    assert main(["plan", str(FIG8), "--policy", "disaggregated"]) == 2
    assert "rollout_gpus" in capsys.readouterr().err


def test_plan_bad_snapshot_names_replica_and_sequence(tmp_path, capsys):
    d = json.loads(FIG8.read_text())
    d["replicas"][5]["sequences"].append(d["replicas"][4]["sequences"][0])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    assert main(["plan", str(bad)]) == 2
    err = capsys.readouterr().err
    sid = d["replicas"][4]["sequences"][0][0]
    assert f"sequence {sid} is on replica ro16 and on replica ro17" in err
    assert main(["plan", str(tmp_path / "missing.json")]) == 2


def test_bench_planner_json(capsys):
    assert main(["bench", "planner", "--gpus", "32", "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"gpus", "replicas", "sequences", "planner_ms", "construction_ms",
            "simulation_ms"} <= set(out)
    assert out["gpus"] == 32 and out["replicas"] == 10 and out["planner_ms"] > 0


def test_bench_dispatch_json(capsys):
    assert main(["bench", "dispatch", "--replicas", "4", "--sequences", "200",
                 "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["replicas"], out["sequences"], out["placed"]) == (4, 200, 200)
    assert out["dispatch_ms"] > 0
