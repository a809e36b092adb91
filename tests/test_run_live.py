"""The tiny job end to end through `pivotrl run` (configs/tiny-cpu.yaml: 2 nodes x 4 capped
devices, vLLM rollout, GenRM TP=2, Megatron TP=2 x DP=2, GPS, MPI), read from its HDF5
trace — while it runs and after. One real run (~4 min on 2 cores): the paradigms' logic is
covered on modeled workers in test_controller.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_run(tiny_models, tmp_path_factory):
    from pivotrl_hpc.trace import open_trace

    out = tmp_path_factory.mktemp("live")
    trace = out / "tiny.h5"
    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "run",
           str(ROOT / "configs" / "tiny-cpu.yaml"),
           f"models.policy.path={tiny_models / 'policy'}",
           f"models.genrm.path={tiny_models / 'genrm'}",
           f"data.train={tiny_models / 'data' / 'train.jsonl'}",
           f"data.validation={tiny_models / 'data' / 'validation.jsonl'}",
           f"trace.path={trace}", "rl.eval_every=3", "rl.eval_prompts=4"]
    before = set(Path("/dev/shm").glob("pivotrl-*"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "UCX_MODULES": "^ib,rdmacm"})
    seen_while_running: list[int] = []
    deadline = time.monotonic() + 900
    while proc.poll() is None and time.monotonic() < deadline:
        if trace.exists():
            try:  # SWMR: the writer holds the file open; a reader sees flushed rows
                with open_trace(str(trace)) as t:
                    if t.summary is None:
                        seen_while_running.append(t.rows("steps"))
            except OSError:
                pass  # created but not yet switched to SWMR
        time.sleep(2)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output[-4000:]
    left = set(Path("/dev/shm").glob("pivotrl-*")) - before
    return {"trace": trace, "output": output, "seen": seen_while_running, "left": left,
            "summary": json.loads(trace.with_suffix(".summary.json").read_text())}


def test_three_steps_and_a_summary_a_person_can_read(tiny_run):
    s = tiny_run["summary"]
    assert s["steps"] == 3 and s["paradigm"] == "shiftable"
    assert s["tokens_per_s"] > 0 and s["in_flight_at_end"] == 0
    assert "end-to-end" in tiny_run["output"] and "shifts:" in tiny_run["output"]
    assert [v["step"] for v in s["validation"]] == [3]


def test_a_reader_sees_steps_appear_while_the_job_runs(tiny_run):
    seen = tiny_run["seen"]
    assert seen, "the trace was never readable while the job ran"
    assert seen == sorted(seen)


def test_nothing_lost_and_staleness_held_from_the_trace(tiny_run):
    from pivotrl_hpc.trace import open_trace

    with open_trace(str(tiny_run["trace"])) as t:
        seq, steps, shifts = t.table("sequences"), t.table("steps"), t.table("shifts")
    finishes = Counter((r, i) for e, r, i in zip(seq["event"], seq["role"], seq["seq_id"])
                       if e == "finish")
    rollout = {i for (r, i) in finishes if r == "rollout"}
    reward = {i for (r, i) in finishes if r == "reward"}
    assert set(finishes.values()) == {1}            # every sequence finishes exactly once
    trained = 3 * 4 * 4                              # steps x batch x group
    assert reward <= rollout and len(reward) == trained
    assert list(steps["samples"]) == [16, 16, 16] and steps["max_lag"].max() <= 2
    assert set(shifts["direction"]) == {"up", "down"}
    assert {"reward", "rollout", "training"} <= set(shifts["role"])
    reward_ups = [d for r, d, di in zip(shifts["role"], shifts["devices"], shifts["direction"])
                  if r == "reward" and di == "up"]
    assert reward_ups and all(len(d.split(",")) == 2 for d in reward_ups)   # GenRM TP=2
    train_up = [d for r, d, di in zip(shifts["role"], shifts["devices"], shifts["direction"])
                if r == "training" and di == "up"]
    assert train_up == ["0,1,2,3"]                   # TP=2 x DP=2
    assert all("total" in p for p in shifts["phases"])


def test_nothing_of_the_job_left_in_shm(tiny_run):
    assert tiny_run["left"] == set()
