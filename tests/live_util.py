"""Real `pivotrl run` jobs for the live tests: the command, its output, its summary, what it
left in /dev/shm, and (optionally) what a reader saw in the trace while the job ran."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTENTION = 2   # CPU spinners beside one live job per paradigm: races show under load (issue 47)


def shm_entries() -> set[Path]:
    """pivotrl's entries in /dev/shm (vLLM's TP communicators) and in this user's GPS folder."""
    from pivotrl_hpc.gps.shmdir import SHM_DIR
    return set(Path("/dev/shm").glob("pivotrl-tp*")) | set(SHM_DIR.glob("pivotrl-*"))


def model_overrides(models: Path) -> list[str]:
    return [f"models.policy.path={models / 'policy'}", f"models.genrm.path={models / 'genrm'}",
            f"data.train={models / 'data' / 'train.parquet'}",
            f"data.validation={models / 'data' / 'aime-style.parquet'}"]


def run_job(config: str, models: Path, trace: Path, overrides: list[str],
            timeout_s: float = 900, watch: bool = False, contention: int = 0) -> dict:
    """Run one job to its end; return trace path, output, summary, steps seen while it ran
    (with `watch`) and the /dev/shm entries of pivotrl it left. `contention`: that many CPU
    spinners run beside it (races show under load: `pivotrl bench soak --contention`)."""
    from pivotrl_hpc.cli.bench_contention import spinners

    with spinners(contention):
        return _run_job(config, models, trace, overrides, timeout_s, watch)


def run_jobs_side_by_side(jobs: dict[str, tuple], at_once: int = 2) -> dict[str, Future]:
    """`run_job(*args, **kwargs)` for each name -> (args, kwargs), `at_once` at a time
    (suite time: a short job is mostly its start-up, which leaves cores idle; memory caps
    `at_once`). Returns when all have ended; each test takes its job's result (or failure)
    from its future."""
    with ThreadPoolExecutor(at_once) as pool:
        futures = {name: pool.submit(run_job, *args, **kwargs)
                   for name, (args, kwargs) in jobs.items()}
        wait(futures.values())
    return futures


def _run_job(config: str, models: Path, trace: Path, overrides: list[str],
             timeout_s: float, watch: bool) -> dict:
    from pivotrl_hpc.trace import open_trace

    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "run", str(ROOT / "configs" / config),
           *model_overrides(models), f"trace.path={trace}", *overrides]
    before = shm_entries()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "UCX_MODULES": "^ib,rdmacm"})
    seen: list[int] = []
    deadline = time.monotonic() + timeout_s
    while watch and proc.poll() is None and time.monotonic() < deadline:
        if trace.exists():
            try:  # SWMR: the writer holds the file open; a reader sees flushed rows
                with open_trace(str(trace)) as t:
                    if t.summary is None:
                        seen.append(t.rows("steps"))
            except OSError:
                pass  # created but not yet switched to SWMR
        time.sleep(2)
    try:
        output = proc.communicate(timeout=max(60.0, deadline - time.monotonic()))[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        output = proc.communicate()[0]
        raise AssertionError(f"{config} {overrides} did not finish in {timeout_s:.0f} s:\n"
                             + output[-4000:]) from None
    assert proc.returncode == 0, output[-4000:]
    # this job's leftovers only: another job on the machine may hold segments meanwhile
    job = (trace.with_suffix(".logs") / "job").read_text().strip()
    left = {p for p in shm_entries() - before
            if f"-{job}-" in p.name or p.name.startswith("pivotrl-tp")}
    return {"trace": trace, "output": output, "seen": seen, "left": left,
            "summary": json.loads(trace.with_suffix(".summary.json").read_text())}


def assert_trace_ok(*traces: Path) -> None:
    """`pivotrl trace check`: every invariant of docs/trace.md holds on each trace."""
    from pivotrl_hpc.trace.check import check

    for trace in traces:
        bad = [r.line() for r in check(trace) if not r.ok]
        assert not bad, f"{trace}:\n" + "\n".join(bad)


def check_nothing_lost(trace: Path, steps: int, per_step: int, staleness: int) -> dict:
    """From the trace: every sequence finishes exactly once, every trained sample was
    rolled out and judged, each step trains `per_step` samples, the lag stays <= staleness; and
    the trace passes `pivotrl trace check`."""
    from pivotrl_hpc.trace import open_trace

    assert_trace_ok(trace)

    with open_trace(str(trace)) as t:
        seq, st, shifts = t.table("sequences"), t.table("steps"), t.table("shifts")
    finishes = Counter((r, i) for e, r, i in zip(seq["event"], seq["role"], seq["seq_id"])
                       if e == "finish")
    rollout = {i for (r, i) in finishes if r == "rollout"}
    reward = {i for (r, i) in finishes if r == "reward"}
    assert set(finishes.values()) == {1}            # every sequence finishes exactly once
    assert reward <= rollout and len(reward) == steps * per_step
    assert list(st["samples"]) == [per_step] * steps and st["max_lag"].max() <= staleness
    return {"steps": st, "shifts": shifts}


def check_batch_cycle(seq: dict, steps: dict) -> dict:
    """rr_colocated as Appendix E runs it, from a trace's `sequences` and `steps` columns
    (live or simulated): for every batch b, no judgement of b starts before every rollout
    of b has finished, and no rollout of b + 1 starts before every judgement of b has
    finished; some training step runs while the pool rolls out or judges a later batch.
    A sequence starts at its first `dispatch`. Returns the per-batch times."""
    first: dict[tuple[str, str], float] = {}
    ends: dict[tuple[str, int], list[float]] = {}
    starts: dict[tuple[str, int], list[float]] = {}
    for t, ev, role, sid, b in zip(seq["t"], seq["event"], seq["role"], seq["seq_id"],
                                   seq["step"]):
        if b < 0 or role not in ("rollout", "reward"):
            continue
        if ev == "dispatch" and (role, sid) not in first:
            first[role, sid] = float(t)
            starts.setdefault((role, int(b)), []).append(float(t))
        elif ev == "finish":
            ends.setdefault((role, int(b)), []).append(float(t))
    batches = sorted({b for _, b in ends})
    times = {b: {"rollout": (min(starts["rollout", b]), max(ends["rollout", b])),
                 "reward": (min(starts["reward", b]), max(ends["reward", b]))}
             for b in batches}
    for b in batches:
        assert times[b]["reward"][0] >= times[b]["rollout"][1], \
            f"batch {b}: a judgement started before its last rollout finished {times[b]}"
        if b + 1 in times:
            assert times[b + 1]["rollout"][0] >= times[b]["reward"][1], \
                f"batch {b + 1}'s rollout started before batch {b} was judged {times}"
    overlap = [(s, b) for s, end, secs in zip(steps["step"], steps["t"], steps["seconds"])
               for b in batches if b > s for role in ("rollout", "reward")
               if times[b][role][0] < end and times[b][role][1] > end - secs]
    assert overlap, f"no training step overlaps a later batch's rollout or reward {times}"
    return times
