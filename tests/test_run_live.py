"""The tiny job end to end through `pivotrl run` (configs/tiny-cpu.yaml: 2 nodes x 4 capped
devices, vLLM rollout, GenRM TP=2, Megatron TP=2 x DP=2, GPS, MPI), read from its HDF5
trace — while it runs and after. One real run (~4 min on 2 cores): the paradigms' logic is
covered on modeled workers in test_controller.py."""
from __future__ import annotations

import pytest
from live_util import check_nothing_lost, run_job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_run(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("live")
    return run_job("tiny-cpu.yaml", tiny_models, out / "tiny.h5",
                   ["rl.eval_every=3", "rl.eval_prompts=4"], watch=True)


def test_three_steps_and_a_summary_a_person_can_read(tiny_run):
    s = tiny_run["summary"]
    assert s["steps"] == 3 and s["paradigm"] == "shiftable"
    assert s["tokens_per_s"] > 0 and s["in_flight_at_end"] == 0
    assert "end-to-end" in tiny_run["output"] and "shifts:" in tiny_run["output"]
    assert [v["step"] for v in s["validation"]] == [3]
    rss = s["peak_rss_mb"]                           # every worker rank and engine host
    assert sorted(rss) == [str(d) for d in range(8)]
    assert all(v["worker"] > 50 for v in rss.values())
    assert all(v["host:genrm"] > 200 for v in rss.values())   # every device served GenRM
    assert "peak RSS: worker ranks" in tiny_run["output"]


def test_a_reader_sees_steps_appear_while_the_job_runs(tiny_run):
    seen = tiny_run["seen"]
    assert seen, "the trace was never readable while the job ran"
    assert seen == sorted(seen)


def test_nothing_lost_and_staleness_held_from_the_trace(tiny_run):
    shifts = check_nothing_lost(tiny_run["trace"], steps=3, per_step=4 * 4, k=2)["shifts"]
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
