"""How a job continues: where it resumes from (every rank, at start), and a checkpoint asked
for from outside while it runs (the batch step, on Slurm's time-limit signal or submitit's).
docs/checkpoints.md tells the whole story."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from pathlib import Path

from pivotrl_hpc.checkpoint.layout import REQUEST_FILE, latest, root_for, segments
from pivotrl_hpc.launch.layout import CONTROLLER_RANK, LaunchError

log = logging.getLogger("pivotrl_hpc.launch")


def resolve_everywhere(world, cfg, controller: bool) -> dict | None:
    """Rank 0 finds the checkpoint to start from (checkpoint.state.prepare) and tells every
    rank, so all of them start from the same one, or all stop with its error; `cfg.resume`
    becomes that folder ("" for a fresh start). Returns its folder, step and version."""
    from pivotrl_hpc.checkpoint.layout import CheckpointError
    from pivotrl_hpc.checkpoint.state import prepare

    got: dict | None = None
    if controller:
        try:
            got = {"resumed": prepare(cfg)}
        except CheckpointError as e:
            got = {"error": str(e)}
    got = world.bcast(got, root=CONTROLLER_RANK)
    if "error" in got:
        raise LaunchError(f"resume: {got['error']}")
    resumed = got["resumed"]
    cfg.resume = resumed["path"] if resumed else ""
    if resumed and controller:
        log.info("resuming from %s (step %d, policy v%d)", resumed["path"], resumed["step"],
                 resumed["version"])
    return resumed


def forget_segments(trace: Path) -> None:
    """A fresh start rewrites the run's trace: later segments of an older run would follow
    it as if they continued it. Its checkpoints stay (new ones replace them step by step)."""
    for old in segments(trace)[1:]:
        old.unlink()
    if (ckpt := latest(root_for(trace))) is not None:
        log.warning("starting afresh (resume=false) in a run that holds checkpoints up to %s; "
                    "new ones replace them", ckpt.name)


RUNNING: list = []   # the launch.local.PreparedRun launch.slurm.execute drives now


def checkpoint_now(wait_s: float) -> Path | None:
    """A checkpoint of the running job, now (submitit's timeout signal): ask for one after
    the next step and wait until it is whole, at most `wait_s`; the newest whole one."""
    if not RUNNING:
        return None
    run = RUNNING[-1]
    root = root_for(run.paths.trace)
    before = latest(root)
    request_checkpoint(run.paths.logs, "checkpoint")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        now = latest(root)
        if now is not None and now != before:
            log.warning("checkpoint %s written for the requeue", now)
            return now
        time.sleep(0.5)
    log.error("no new checkpoint within %.0f s: the requeued job resumes from %s", wait_s,
              before or "the start")
    return before


def stop_grace(base_s: float, preempt_grace_s: float, margin_s: float) -> float:
    """How long a process waits for the ranks after a stop signal: `base_s`, or longer with a
    preemption grace time, so that the controller's checkpoint inside it is not cut short
    (ranks < launcher < batch step, by `margin_s` each; Slurm's SIGKILL ends it anyway)."""
    return max(base_s, preempt_grace_s + margin_s) if preempt_grace_s > 0 else base_s


def requeueable(job: str) -> bool:
    """Whether Slurm may requeue `job` (sbatch --requeue, or the cluster's JobRequeue=1)."""
    p = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True,
                       timeout=30, check=False)
    return p.returncode == 0 and re.search(r"\bRequeue=1\b", p.stdout) is not None


def request_checkpoint(logs: Path, mode: str) -> None:
    """Ask the running controller for a checkpoint after its next step (it polls the file)."""
    tmp = logs / f".{REQUEST_FILE}.tmp"
    tmp.write_text(mode + "\n")
    os.replace(tmp, logs / REQUEST_FILE)


