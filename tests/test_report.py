"""`pivotrl report` on a trace whose every number is known: the device timeline, the summary
table against numbers worked out by hand, the figures and the Perfetto JSON."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from report_util import check_report

from pivotrl_hpc.report import markdown, numbers
from pivotrl_hpc.report.timeline import device_spans, low_throughput_fraction
from pivotrl_hpc.trace import TraceWriter, open_trace

# 4 devices, 100 s. Devices 0-1: rollout from 10 s (shift up 2-10 s), shift down 50-52 s,
# training from 60 s (shift up 55-60). Devices 2-3: reward (TP=2) from 5 s (up 1-5 s).
SHIFTS = [
    dict(t=10.0, direction="up", role="rollout", replica="r0", devices="0", seconds=8.0,
         phases={"parameters.read": 1.0, "preserved.engine_start": 6.0,
                 "parameters.load": 0.5}),
    dict(t=10.0, direction="up", role="rollout", replica="r1", devices="1", seconds=8.0,
         phases={"parameters.read": 2.0, "preserved.engine_start": 5.0}),
    dict(t=5.0, direction="up", role="reward", replica="g0", devices="2,3", seconds=4.0,
         phases={"parameters.read": 1.0, "parameters.load": 2.0}),
    dict(t=52.0, direction="down", role="rollout", replica="r0", devices="0", seconds=2.0,
         phases={"temporary.abort": 0.5, "preserved.engine_stop": 1.0, "total": 2.0}),
    dict(t=52.0, direction="down", role="rollout", replica="r1", devices="1", seconds=2.0,
         phases={"temporary.abort": 0.5, "preserved.engine_stop": 1.5, "total": 2.0}),
    dict(t=60.0, direction="up", role="training", replica="t0", devices="0,1", seconds=5.0,
         phases={"offloadable.reload.total": 3.0, "offloadable.reload.grads": 1.0,
                 "offloadable.reload.trim": 1.5, "parameters.load": 1.0}),
]
STEPS = [dict(t=80.0, step=0, version=1, samples=8, tokens=400, reward_mean=0.25,
              reward_std=0.1, loss=1.5, max_lag=0, val_accuracy=0.5, seconds=20.0),
         dict(t=95.0, step=1, version=2, samples=8, tokens=600, reward_mean=0.75,
              reward_std=0.2, loss=1.1, max_lag=1, seconds=15.0)]
# two sequences dispatched from the queue, then one moved r0 -> r1 when r0 shifts down (its
# abort on r0 comes with the ShiftDown's reply): one migration
SEQUENCES = [dict(t=11.0, seq_id="0", event="dispatch", role="rollout", replica="r0"),
             dict(t=11.0, seq_id="1", event="dispatch", role="rollout", replica="r1"),
             dict(t=50.0, seq_id="0", event="migrate", role="rollout", replica="r1"),
             dict(t=52.0, seq_id="0", event="abort", role="rollout", replica="r0")]


def _timeseries(w: TraceWriter) -> None:
    # rollout: 2 devices 10-50 s; 40 tok/s per device for 30 s, then 4 (< 20 % of peak) for 10
    for t in range(0, 101, 10):
        rollout = (2, 80.0 if 10 < t <= 40 else 8.0 if 40 < t <= 50 else 0.0)
        w.append("timeseries", t=float(t), role="rollout", devices=rollout[0] if 10 < t <= 50
                 else 0, tokens_per_s=rollout[1])
        w.append("timeseries", t=float(t), role="reward", devices=2 if t > 5 else 0,
                 tokens_per_s=30.0 if t > 5 else 0.0)
        w.append("timeseries", t=float(t), role="training", devices=2 if t > 60 else 0,
                 tokens_per_s=0.0)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "run.h5"
    meta = {"paradigm": "shiftable", "config": {"cluster": {"nodes": 1, "devices_per_node": 4}},
            "device_ranks": {str(d): d + 1 for d in range(4)}}
    with TraceWriter(path, meta=meta) as w:
        for row in SHIFTS:
            w.append("shifts", **row)
        for row in STEPS:
            w.append("steps", **row)
        for row in SEQUENCES:
            w.append("sequences", **row)
        _timeseries(w)
        w.close(summary={"seconds": 100.0})
    return path


def test_device_timeline_by_hand(trace):
    with open_trace(str(trace)) as t:
        spans = device_spans(t.table("shifts"), 4, 100.0)
    d0 = [(s.start, s.end, s.what) for s in spans if s.device == 0]
    assert d0 == [(0.0, 2.0, "idle"), (2.0, 10.0, "shift up rollout"), (10.0, 50.0, "rollout"),
                  (50.0, 52.0, "shift down rollout"), (52.0, 55.0, "idle"),
                  (55.0, 60.0, "shift up training"), (60.0, 100.0, "training")]
    d3 = [(s.start, s.end, s.what) for s in spans if s.device == 3]
    assert d3 == [(0.0, 1.0, "idle"), (1.0, 5.0, "shift up reward"), (5.0, 100.0, "reward")]
    for d in range(4):   # every device covered from 0 to the end, without overlap
        mine = [s for s in spans if s.device == d]
        assert mine[0].start == 0 and mine[-1].end == 100
        assert all(a.end == b.start for a, b in zip(mine, mine[1:]))


def test_summary_numbers_by_hand(trace):
    with open_trace(str(trace)) as t:
        num = numbers(t)
        ts = t.table("timeseries")
    assert (num["devices"], num["seconds"], num["steps"]) == (4, 100.0, 2)
    assert num["trained_tokens"] == 1000 and num["tokens_per_s"] == 10.0
    assert (num["reward_first"], num["reward_last"], num["max_lag"]) == (0.25, 0.75, 1)
    assert num["migrations"] == 1    # the migrate row; the dispatches from the queue are none
    assert {k: v["count"] for k, v in num["shifts"].items()} == {
        "down rollout": 2, "up reward": 1, "up rollout": 2, "up training": 1}
    assert num["shifts"]["up rollout"]["mean_s"] == 8.0
    assert num["shifts"]["up rollout"]["phases"] == {
        "parameters.load": 0.25, "parameters.read": 1.5, "preserved.engine_start": 5.5}
    # device-seconds: rollout 2 x 40; reward 2 x 95; training 2 x 40; shifting
    # 2 x 8 + 2 x 4 + 2 x 2 + 2 x 5; idle the rest of 400
    assert num["device_seconds"] == {"rollout": 80.0, "reward": 190.0, "training": 80.0,
                                     "shift": 38.0, "idle": 12.0}
    # rollout held devices in the rows of 20..50 s: below 20 % of peak in the 50 s row
    assert low_throughput_fraction(ts, "rollout") == pytest.approx(10 / 40)
    # training held devices over 60..100 s (its rows of 70..100) and ran its steps over
    # 60..80 and 80..95: idle 5 of 40 s
    assert num["low_throughput_fraction"] == {"rollout": pytest.approx(0.25), "reward": 0.0,
                                              "training": pytest.approx(5 / 40)}
    table = markdown(num)
    assert "| tokens_per_s | 10.00 |" in table and "| up rollout | 2 | 8.00 |" in table
    assert "| reward | 190.0 | 0.00 |" in table and "| rollout | 80.0 | 0.25 |" in table
    assert "| migrations | 1 |" in table


def test_dispatches_from_the_queue_are_no_migration(tmp_path):
    path = tmp_path / "dispatched.h5"
    with TraceWriter(path, meta={"paradigm": "disaggregated"}) as w:
        for row in SEQUENCES[:2]:
            w.append("sequences", **row)
        w.close(summary={"seconds": 20.0})
    with open_trace(str(path)) as t:
        assert numbers(t)["migrations"] == 0


def test_pivotrl_report_writes_figures_and_a_perfetto_timeline(trace, tmp_path):
    out = tmp_path / "report"
    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "report", str(trace),
                        "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "| trained_tokens | 1000 |" in p.stdout and "ui.perfetto.dev" in p.stdout
    chrome = check_report(out, 4)
    phases = {e["name"]: e for e in chrome["traceEvents"]
              if e["ph"] == "X" and e["cat"] == "phase" and e["tid"] == 0}
    # training's shift up on device 0 began at 55 s: reload (3 s, its parts inside), load
    assert phases["offloadable.reload"]["ts"] == 55e6 and phases["offloadable.reload"]["dur"] == 3e6
    assert phases["grads"]["ts"] == 55e6 and phases["trim"]["ts"] == 56e6
    assert phases["parameters.load"]["ts"] == 58e6
    assert json.loads((out / "summary.json").read_text())["trained_tokens"] == 1000


def test_report_refuses_a_missing_or_unreadable_trace(tmp_path):
    junk = tmp_path / "junk.h5"
    junk.write_text("not hdf5")
    for path, text in ((tmp_path / "none.h5", "no trace at"), (junk, "not a readable trace")):
        p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "report", str(path)],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and text in p.stderr and "Traceback" not in p.stderr, p.stderr
