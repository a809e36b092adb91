"""`pivotrl bench soak --contention N` (cli/bench_contention.py): its spinners burn CPU and
end with it, a failure is reported by its first error line, bad input is refused before any
work. (The live runs under contention: the live tests run their jobs beside spinners,
live_util.run_job; the runs-per-paradigm figures are in docs/history.md.)"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from proc_util import alive

from pivotrl_hpc.cli.bench_contention import first_error, spinners, summarize

ROOT = Path(__file__).resolve().parents[1]


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _state(pid: int) -> str:
    return _stat(pid)[0]


def _cpu_seconds(pid: int) -> float:
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


def test_spinners_burn_cpu_and_are_gone_after():
    with spinners(2) as pids:
        assert len(pids) == 2 and all(alive(p) for p in pids)
        time.sleep(2.0)
        # each one spins: always runnable, never asleep, and it got CPU (little on a machine
        # this loaded, hence no figure)
        assert all(_state(p) == "R" and _cpu_seconds(p) > 0 for p in pids)
    assert not any(alive(p) for p in pids)


def test_a_failure_is_reported_by_its_first_error_line():
    out = ("INFO starting\nrank 3: worker failed on Reload as rollout\n"
           "pivotrl_hpc.controller.flow.ControllerError: Reload failed on device 2\n"
           "Traceback (most recent call last):\n")
    assert first_error(out) == "rank 3: worker failed on Reload as rollout"
    assert first_error("all quiet\nthe end") == "the end"
    runs = [{"paradigm": "shiftable", "ok": False, "rc": 1, "seconds": 9.0, "left": [],
             "error": first_error(out)},
            {"paradigm": "shiftable", "ok": False, "rc": 0, "seconds": 8.0,
             "left": ["pivotrl-tp15800-tp-0_0"], "error": None},
            {"paradigm": "colocated", "ok": True, "rc": 0, "seconds": 7.0, "left": [],
             "error": None}]
    s = summarize(runs, 4, "learn-cpu.yaml", 2)
    assert s["runs"] == 3 and s["failures"] == 2 and s["left_in_shm"] == ["pivotrl-tp15800-tp-0_0"]
    assert s["paradigms"]["shiftable"]["failures"] == 2
    assert s["paradigms"]["shiftable"]["errors"] == [first_error(out)]
    assert s["paradigms"]["colocated"] == {"runs": 1, "failures": 0, "seconds": [7.0],
                                           "errors": [], "left": []}


def test_bad_input_is_refused_before_any_work(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "bench", "soak",
                        "--contention", "2", "--paradigms", "colocated,vanila",
                        "--models", str(tmp_path / "none"), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and p.stdout == ""
    assert "unknown paradigm(s) ['vanila']" in p.stderr
    assert f"pivotrl init-models {tmp_path / 'none'}" in p.stderr
    assert not (tmp_path / "out").exists()          # nothing ran
