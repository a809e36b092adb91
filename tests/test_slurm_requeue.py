"""Long jobs under Slurm survive being stopped (local two-node cluster, real sbatch/scontrol):

- `slurm/pivot.sbatch`: `scontrol requeue` mid-run kills the job and Slurm starts it again:
  it resumes from its last periodic checkpoint; then the time-limit signal (`scancel --batch
  --signal=USR1`, what `--signal=B:USR1@120` sends) makes it checkpoint after its next step
  and requeue itself; the third start finishes. Three trace segments, every step trained.
- preemption: a job of the `urgent` partition (PriorityTier 2) takes the node; Slurm sends
  SIGTERM with a grace time (`GraceTime=90` on `debug`) to the tasks; the job
  (`rl.preempt_grace_s=90`) checkpoints after its running step, ends and requeues itself
  (`scontrol requeue`), and resumes there. (Stopping at
  once and resuming from the last periodic checkpoint, the path without a grace time, is
  what `scontrol requeue` above takes.)
- `pivotrl_hpc.submit`: submitit's timeout signal (USR2 to the batch step) calls
  `PivotJob.checkpoint`, which has the controller checkpoint; submitit requeues; the job
  resumes and `job.result()` is the summary of the whole run.

The submitit job runs shiftable, the sbatch and preempted ones colocated: after a restart
training shifts down again (a restored trainer whose state could not be freed crashed there,
issue 36; colocated shifts it down every step, shiftable when the planner gives its device
to rollout), and every step of every segment trains its batch within the staleness bound.

The three jobs run at once (suite time: each spends most of its time starting engines and
waiting for Slurm, not computing), on nodes that keep them apart: the preempted job alone on
n1 (the urgent job takes all of n1), the other two on n2. The fixture submits them, drives
each from its own thread and keeps what each test asserts on.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from live_util import assert_trace_ok, model_overrides
from slurm_util import ROOT, job_segments, submit_pivot, wait_job

pytestmark = pytest.mark.slurm
LEARN = str(ROOT / "configs" / "learn-cpu.yaml")
STEPS = 6
OVERRIDES = [f"rl.steps={STEPS}", "rl.checkpoint_every=2", "rl.batch_size=4"]
# the submitit job runs longer: its timeout signal reaches the controller through a file the
# batch step writes, a step or three after it was sent (seen: steps 0-4 before the stop),
# and shiftable moves training down only now and then; it ends before the requeued job,
# which it runs beside
SUBMITIT_STEPS = 12
# the preempted job runs longer too: the urgent job is submitted after its 3rd step, and
# Slurm's preemption must reach it before it ends (a busy node answers the submit slowly)
PREEMPTED_STEPS = 10
PER_STEP = 4 * 4     # rl.batch_size x learn-cpu's rl.group_size
# The two colocated jobs run on 2 devices of 0.8 cores, not learn-cpu's 4 of 0.4: the same
# 1.6 cores and the same colocated shifts (training on every device, down every step), at
# about half a start's CPU (each start builds both engines on every device and loads
# Megatron in every worker; 5 of the 7 starts here are colocated).
COLOCATED = ["paradigm.name=colocated", "cluster.devices_per_node=2", "cluster.cpu_share=0.8",
             "paradigm.initial_rollout_devices=1"]


class SkipRequeueDelay:
    """Slurm holds a requeued batch job for 120 s (its BeginTime); the test has it start
    sooner (`scontrol update StartTime=now`, what an operator may do) so that it does not wait
    4 minutes for nothing. The requeue itself is Slurm's own.

    Not at once, though: the kill of the previous start revokes the job's credential on the
    node, and slurmd refuses a relaunch whose credential is from the same second or earlier
    ("already killed, do not launch batch job"); the job then ends FAILED with no output
    (the CI failure of a self-requeue relaunched within its own second). The hold is cut
    only after the job has been pending for `SETTLE_S`."""

    SETTLE_S = 3.0

    def __init__(self, cluster, job: str):
        import threading

        self.cluster, self.job, self.done = cluster, job, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        held_since = None
        while not self.done.wait(0.5):
            p = self.cluster.run("squeue", "-h", "-j", self.job, "-o", "%T %r", check=False)
            if p.stdout.split() != ["PENDING", "BeginTime"]:
                held_since = None
            elif held_since is None:
                held_since = time.monotonic()
            elif time.monotonic() - held_since >= self.SETTLE_S:
                self.cluster.run("scontrol", "update", f"JobId={self.job}", "StartTime=now",
                                 check=False)
                held_since = None

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def _wait_for(what: str, check, timeout: float = 600, logs: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s" + _tails(logs)
        time.sleep(0.5)


def _tails(logs: Path | None, lines: int = 25) -> str:
    """rank 0's log of each start so far (launch.layout keeps an earlier start's)."""
    if logs is None:
        return ""
    out = []
    for log in sorted(logs.glob("start-*/rank-0.log")) + [logs / "rank-0.log"]:
        if log.exists():
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"\n--- {log}\n" + "\n".join(tail))
    return "".join(out)


def _rows(trace: Path, table: str = "steps") -> int:
    from pivotrl_hpc.trace import open_trace

    try:
        with open_trace(str(trace)) as t:
            return t.rows(table)
    except (OSError, KeyError):
        return -1


def _check_segments(trace: Path, n: int, steps_in_all: int = STEPS) -> list[dict]:
    from pivotrl_hpc.checkpoint.layout import segments
    from pivotrl_hpc.trace import open_trace

    parts = segments(trace)
    assert len(parts) == n, parts
    assert_trace_ok(*parts)
    out, steps = [], set()
    for i, path in enumerate(parts):
        with open_trace(str(path)) as t:
            meta, st = t.meta, t.table("steps")
            events = list(zip(t.table("events")["kind"], t.table("events")["message"]))
            down = [r for r, d in zip(t.table("shifts")["role"], t.table("shifts")["direction"])
                    if r == "training" and d == "down"]
        steps |= {int(s) for s in st["step"]}
        assert bool(meta["resumed_from"]) == (i > 0)
        assert list(st["samples"]) == [PER_STEP] * len(st["step"]) and \
            (len(st["step"]) == 0 or int(st["max_lag"].max()) <= 2), (i, st)
        out.append({"meta": meta, "steps": [int(s) for s in st["step"]], "events": events,
                    "training_down": len(down)})
    assert steps == set(range(steps_in_all))
    return out


def _restarts(cluster, job: str) -> int:
    info = cluster.run("scontrol", "show", "job", "-o", job).stdout
    return int(dict(t.split("=", 1) for t in info.split() if "=" in t)["Restarts"])


def _requeued(cluster, models: Path, tmp: Path) -> Callable[[], dict]:
    """sbatch on n2; `scontrol requeue` once step 2's checkpoint is whole; the time-limit
    signal once the second start trained a step; the third start finishes."""
    folder = tmp / "requeued"
    job = submit_pivot(cluster, folder, ["--gres=gpu:2", "--time=30", "-w", "n2"], LEARN,
                       [*model_overrides(models), *OVERRIDES, *COLOCATED])
    run = folder / "runs" / f"pivotrl-{job}"
    ckpts, logs = run / "learn-cpu.checkpoints", run / "learn-cpu.logs"

    def drive() -> dict:
        skip = SkipRequeueDelay(cluster, job)
        try:
            _wait_for("checkpoint of step 2",
                      lambda: (ckpts / "step-000002" / "COMPLETE").exists())
            cluster.run("scontrol", "requeue", job)
            _wait_for("a step trained after the requeue",
                      lambda: _rows(run / "learn-cpu.seg1.h5") >= 1, logs=logs)
            cluster.run("scancel", "--batch", "--signal=USR1", job)
            res = wait_job(cluster, job, folder / "job.out", timeout=900)
        finally:
            skip.stop()
        return {"job": job, "res": res, "trace": run / "learn-cpu.h5", "logs": logs,
                "restarts": _restarts(cluster, job)}
    return drive


def _preempted(cluster, models: Path, tmp: Path) -> Callable[[], dict]:
    """sbatch on n1 (rl.preempt_grace_s=90, no periodic checkpoints); a job of the `urgent`
    partition takes all of n1 once 3 steps are trained."""
    folder = tmp / "preempted"
    job = submit_pivot(cluster, folder, ["--gres=gpu:2", "--time=30", "-w", "n1"],
                       LEARN, [*model_overrides(models), *OVERRIDES, "rl.checkpoint_every=0",
                               "rl.preempt_grace_s=90", *COLOCATED,
                               f"rl.steps={PREEMPTED_STEPS}"])
    run = folder / "runs" / f"pivotrl-{job}"

    def drive() -> dict:
        skip = SkipRequeueDelay(cluster, job)
        try:
            # two step intervals: the controller can tell whether a step fits in the grace
            _wait_for("3 trained steps", lambda: _rows(run / "learn-cpu.h5") >= 3)
            urgent = cluster.sbatch("-p", "urgent", "-w", "n1", "--gres=gpu:8", "--time=2",
                                    "-o", "/dev/null", "--wrap", "sleep 5", cwd=tmp)
            res = wait_job(cluster, job, folder / "job.out", timeout=900)
        finally:
            skip.stop()
        return {"job": job, "res": res, "trace": run / "learn-cpu.h5",
                "urgent": wait_job(cluster, urgent).state, "restarts": _restarts(cluster, job)}
    return drive


def _submitit(cluster, models: Path, tmp: Path) -> Callable[[], dict]:
    """`pivotrl_hpc.submit` on n2 (shiftable, no periodic checkpoints); submitit's timeout
    signal (USR2 to the batch step) once a step is trained."""
    import pivotrl_hpc

    root = tmp / "submitit-runs"
    job = pivotrl_hpc.submit(LEARN, [*model_overrides(models), *OVERRIDES,
                                     "rl.checkpoint_every=0", f"rl.steps={SUBMITIT_STEPS}"],
                             runs_root=root, time=30,
                             additional_parameters={"nodelist": "n2"})
    trace = root / f"pivotrl-{job.job_id}" / "learn-cpu.h5"

    def drive() -> dict:
        skip = SkipRequeueDelay(cluster, job.job_id)
        try:
            _wait_for("a trained step", lambda: _rows(trace) >= 1)
            cluster.run("scancel", "--batch", "--signal=USR2", job.job_id)
            summary = job.result()
        finally:
            skip.stop()
        return {"job": job.job_id, "summary": summary, "trace": trace,
                "restarts": _restarts(cluster, job.job_id)}
    return drive


@pytest.fixture(scope="module")
def stopped_jobs(slurm_cluster, tiny_models, tmp_path_factory) -> dict[str, Future]:
    """The three jobs, submitted one after the other and driven at once; each test takes
    its job's result (or its driver's failure) from the future."""
    tmp = tmp_path_factory.mktemp("requeue")
    with pytest.MonkeyPatch.context() as mp:      # submitit's sbatch/sacct: this cluster
        for k in ("SLURM_CONF", "OMPI_MCA_btl", "UCX_MODULES"):
            mp.setenv(k, slurm_cluster.env[k])
        drivers = {name: make(slurm_cluster, tiny_models, tmp) for name, make in
                   (("preempted", _preempted), ("requeued", _requeued),
                    ("submitit", _submitit))}
        with ThreadPoolExecutor(len(drivers)) as pool:
            futures = {name: pool.submit(drive) for name, drive in drivers.items()}
            for f in futures.values():
                f.exception()                     # all three have ended
    return futures


def test_sbatch_job_requeued_mid_run_and_by_the_time_limit_signal_completes(stopped_jobs):
    r = stopped_jobs["requeued"].result()
    res, job, logs = r["res"], r["job"], r["logs"]
    assert res.state == "COMPLETED" and res.exit_code == 0, res.output[-3000:]
    assert r["restarts"] == 2
    assert "requeued: it resumes from there" in res.output, res.output[-3000:]
    # the requeue's SIGTERM stopped the first start's controller (its log kept beside)
    first = (logs / "start-1" / "rank-0.log").read_text()
    assert "controller stopped by SIGTERM" in first, first[-3000:]
    segs = _check_segments(r["trace"], 3)
    assert segs[0]["meta"]["paradigm"] == "colocated"
    assert segs[1]["training_down"] >= 1, segs        # shifted down after resuming
    assert any(kind == "checkpoint" for kind, _ in segs[1]["events"])
    # the signal's checkpoint is the one the third start resumed from
    assert Path(segs[2]["meta"]["resumed_from"]).name == f"step-{segs[1]['steps'][-1] + 1:06d}"
    assert job_segments(job) == []


def test_preempted_job_checkpoints_in_its_grace_time_is_requeued_and_resumes_there(
        stopped_jobs):
    """`debug` has GraceTime=90: the job (rl.preempt_grace_s=90, no periodic checkpoints)
    checkpoints after the step it was running when the preemption's SIGTERM came, and the
    requeued job resumes from exactly that checkpoint."""
    r = stopped_jobs["preempted"].result()
    res = r["res"]
    assert res.state == "COMPLETED" and res.exit_code == 0, res.output[-3000:]
    assert r["urgent"] == "COMPLETED"
    # the controller's own log of the first start (srun may stop forwarding a task's output
    # once Slurm's SIGTERM reaches it: the line once went missing from the job's output)
    first = (r["trace"].parent / "learn-cpu.logs" / "start-1" / "rank-0.log").read_text()
    assert "checkpoint after the running step, then stop" in first, first[-3000:]
    # Slurm signals the tasks, not the batch step: the job ends its first start as done
    # after the checkpoint and requeues itself, as at the time limit
    assert "after a stop signal" in res.output and "requeued: it resumes from there" in \
        res.output, res.output[-3000:]
    assert r["restarts"] == 1
    segs = _check_segments(r["trace"], 2, PREEMPTED_STEPS)
    assert segs[0]["meta"]["paradigm"] == "colocated" and segs[1]["training_down"] >= 1
    # the grace-time checkpoint is the one the second start resumed from
    assert Path(segs[1]["meta"]["resumed_from"]).name == f"step-{segs[0]['steps'][-1] + 1:06d}"
    assert job_segments(r["job"]) == []


def test_submitit_timeout_signal_checkpoints_and_requeues(stopped_jobs):
    r = stopped_jobs["submitit"].result()
    summary, job = r["summary"], r["job"]
    assert summary["steps"] == SUBMITIT_STEPS and summary["job_id"] == job
    segs = _check_segments(r["trace"], 2, SUBMITIT_STEPS)
    assert Path(segs[1]["meta"]["resumed_from"]).name.startswith("step-")
    assert segs[1]["training_down"] >= 1
    assert r["restarts"] == 1
    assert job_segments(job) == []


SELF_REQUEUE = """#!/bin/bash
#SBATCH --requeue
#SBATCH --open-mode=append
echo "start ${SLURM_RESTART_COUNT:-0}"
if [ "${SLURM_RESTART_COUNT:-0}" -lt 1 ]; then
  sleep 1.2
  # requeue just before slurmctld's scheduling tick (about .6 s into a second here), so that
  # a hold cut at once relaunches the job within the second of its kill
  while f=$(date +%N); [ "${f:0:2}" -lt 50 ] || [ "${f:0:2}" -gt 56 ]; do sleep 0.005; done
  scontrol requeue "$SLURM_JOB_ID"; sleep 5
fi
echo done
"""


def test_skip_requeue_delay_relaunches_a_self_requeued_job(slurm_cluster, tmp_path):
    """The helper above must not relaunch a job in the second its previous start was killed
    (slurmd: "already killed, do not launch batch job"; the job ends FAILED, no output)."""
    script, out = tmp_path / "self_requeue.sh", tmp_path / "out.txt"
    script.write_text(SELF_REQUEUE)
    job = slurm_cluster.sbatch("-o", str(out), str(script), cwd=tmp_path)
    skip = SkipRequeueDelay(slurm_cluster, job)
    try:
        res = wait_job(slurm_cluster, job, out, timeout=120)
    finally:
        skip.stop()
    assert (res.state, res.exit_code) == ("COMPLETED", 0), res.output
    assert res.output.count("start") == 2 and res.output.rstrip().endswith("done"), res.output
    assert _restarts(slurm_cluster, job) == 1
