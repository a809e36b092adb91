"""The paradigms the other live tests do not run, through `pivotrl run` on the learn-cpu
layout (1 node x 4 capped devices, TP=1): rr_colocated for 3 steps (one batch at a time on
its pool, Appendix E), the ablations static,
rule_based and vanilla for 1 step each. (colocated, disaggregated and shiftable run 20
steps in test_learning.py; shiftable with TP=2 replicas in test_run_live.py.)"""
from __future__ import annotations

from concurrent.futures import Future

import pytest
from live_util import CONTENTION, check_nothing_lost, run_jobs_side_by_side

pytestmark = pytest.mark.slow
STEPS = {"rr_colocated": 3, "static": 1, "rule_based": 1, "vanilla": 1}


@pytest.fixture(scope="module")
def paradigm_runs(tiny_models, tmp_path_factory) -> dict[str, Future]:
    """The four jobs, two at a time. rr_colocated's one run beside CPU spinners (issue 47;
    the others: test_learning.py)."""
    out = tmp_path_factory.mktemp("paradigms")
    return run_jobs_side_by_side({
        p: (("learn-cpu.yaml", tiny_models, out / f"{p}.h5",
             [f"paradigm.name={p}", f"rl.steps={n}"]),
            {"contention": CONTENTION if p == "rr_colocated" else 0})
        for p, n in STEPS.items()})


@pytest.mark.parametrize("paradigm,steps", list(STEPS.items()))
def test_paradigm_completes_its_steps_and_loses_nothing(paradigm_runs, tmp_path, paradigm,
                                                        steps):
    run = paradigm_runs[paradigm].result()
    s = run["summary"]
    assert s["paradigm"] == paradigm and s["steps"] == steps
    assert s["in_flight_at_end"] == 0 and run["left"] == set()
    shifts = check_nothing_lost(run["trace"], steps, 8 * 4, staleness=2)["shifts"]
    assert {"rollout", "reward"} <= set(shifts["role"])
    if paradigm == "rr_colocated":  # rollout and reward alternate on the same devices
        pool = {d for r, d in zip(shifts["role"], shifts["devices"]) if r == "reward"}
        assert pool & {d for r, d in zip(shifts["role"], shifts["devices"]) if r == "rollout"}
        _check_one_batch_at_a_time(run["trace"], steps)
        _check_report_of_a_live_trace(run["trace"], tmp_path / "report", s)


def _check_one_batch_at_a_time(trace, steps: int) -> None:
    """Appendix E on the live trace: the pool rolls out a batch, judges it, then the next,
    while training runs beside it (live_util.check_batch_cycle; the simulated one in
    test_rr_colocated)."""
    from live_util import check_batch_cycle
    from pivotrl_hpc.trace import open_trace

    with open_trace(str(trace)) as t:
        assert len(check_batch_cycle(t.table("sequences"), t.table("steps"))) == steps


def _check_report_of_a_live_trace(trace, out, summary: dict) -> None:
    """`pivotrl report` on the live trace: figures, Perfetto JSON, and numbers that agree
    with the run's own summary."""
    import json
    import subprocess
    import sys

    from report_util import check_report

    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "report", str(trace),
                        "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    check_report(out, 4)
    num = json.loads((out / "summary.json").read_text())
    assert num["steps"] == summary["steps"] and num["trained_tokens"] == summary["trained_tokens"]
    from pivotrl_hpc.trace import open_trace
    with open_trace(str(trace)) as t:
        rows = t.table("shifts")
    assert sum(v["count"] for v in num["shifts"].values()) == len(rows["t"])
    # the run's summary counts device shifts up (`from->to` per device)
    assert sum(len(d.split(",")) for d, way in zip(rows["devices"], rows["direction"])
               if way == "up") == summary["shifts"]
    assert sum(num["device_seconds"].values()) >= 4 * num["seconds"] * 0.99
