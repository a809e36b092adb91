"""How a job continues: where it resumes from (every rank, at start), and a checkpoint asked
for from outside while it runs (the batch step, on Slurm's time-limit signal or submitit's).
docs/checkpoints.md tells the whole story."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from pivotrl_hpc.checkpoint.folders import new_folder_at, open_folder, read_own, write_at
from pivotrl_hpc.checkpoint.layout import REQUEST_FILE, latest, root_for, segments
from pivotrl_hpc.launch.layout import CONTROLLER_RANK, LaunchError
from pivotrl_hpc.protocol import mpi
from pivotrl_hpc.protocol.wire import PLAIN

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
    got = mpi.bcast(world, PLAIN, got, CONTROLLER_RANK)
    if "error" in got:
        raise LaunchError(f"resume: {got['error']}")
    resumed = got["resumed"]
    cfg.resume = resumed["path"] if resumed else ""
    if resumed and controller:
        log.info("resuming from %s (step %d, policy v%d)", resumed["path"], resumed["step"],
                 resumed["version"])
    return resumed


def absolute_resume(overrides: Sequence[str], base: Path) -> list[str]:
    """`resume=PATH` relative to `base` (the submit directory), as a user means it; the
    config loader would take it from the config's folder, as it does the config's paths."""
    from pivotrl_hpc.config.schema import names_a_path

    out = []
    for o in overrides:
        key, eq, value = o.partition("=")
        if eq and key.strip() == "resume" and names_a_path(value) and \
                not Path(value).is_absolute():
            o = f"resume={base / value}"
        out.append(o)
    return out


def continue_in(resume: bool | str) -> Path | None:
    """The trace of the run a job named by `resume=PATH` continues (`pivotrl resume`,
    `sbatch ... resume=runs/NAME-ID`): that checkpoint's run folder, not a new one, so the
    run's trace gets its next segment beside the others. None: `resume` names no path."""
    from pivotrl_hpc.checkpoint.layout import CheckpointError, find
    from pivotrl_hpc.config.schema import names_a_path

    if not names_a_path(resume):
        return None
    try:
        ckpt = find(resume)
    except CheckpointError as e:
        raise LaunchError(f"resume={resume}: {e}") from None
    root = ckpt.parent     # <run>/<name>.checkpoints
    return root.parent / (root.name.removesuffix(".checkpoints") + ".h5")


def earlier_runs(runs: Path, job_name: str, trace_name: str, this: Path) -> str | None:
    """A new job (no `resume=PATH`) of a name whose earlier runs under `runs` hold
    checkpoints of the same config: say so and how to continue the newest of them."""
    from pivotrl_hpc.checkpoint.layout import latest

    found = []
    for run in runs.glob(f"{job_name}-*"):
        ckpt = latest(root_for(run / trace_name))
        if run != this and ckpt is not None:
            found.append((ckpt.stat().st_mtime, run, ckpt))
    if not found:
        return None
    _, run, ckpt = max(found)
    return (f"{run} holds checkpoints of this config (newest {ckpt.name}); this job starts "
            f"afresh in {this}. To continue that run instead: pivotrl resume {run} (or sbatch "
            f"slurm/pivot.sbatch CONFIG resume={run})")


ASIDE = "fresh_aside"   # resume=fresh_aside: move an earlier run aside, then start afresh
_RUN_SUFFIXES = (".checkpoints", ".summary.json", ".config.json", ".logs", ".tensorboard")


def fresh(resume: bool | str) -> bool:
    """Whether `resume` asks for a fresh start over whatever the run folder holds."""
    return resume in (False, "false", "")


def held_run(trace: str | os.PathLike) -> str | None:
    """What an earlier run of this name left beside `trace` that a fresh start would lose
    (its trace segments, its whole checkpoints), in words; None when neither is there."""
    parts = []
    if segs := segments(trace):
        more = f" + {len(segs) - 1} later segment(s)" if len(segs) > 1 else ""
        parts.append(f"trace {segs[0].name}{more}")
    if (ckpt := latest(root_for(trace))) is not None:
        parts.append(f"checkpoints up to {ckpt.name}")
    return " and ".join(parts) or None


def check_owner(resume: bool | str, trace: str | os.PathLike) -> None:
    """A run folder has one owner run: a fresh start (resume=false) where an earlier run of
    this name left its trace or checkpoints is refused, naming them and the ways on."""
    if not fresh(resume) or (what := held_run(trace)) is None:
        return
    folder = Path(trace).parent
    raise LaunchError(f"{folder} holds an earlier run of {Path(trace).name} ({what}) that "
                      f"resume=false would overwrite: resume=auto continues it, a new "
                      f"trace.path starts afresh in a new folder, resume={ASIDE} moves it to "
                      f"{folder}/old-<time>/ and starts afresh here")


def move_aside(trace: str | os.PathLike, group_shared: bool = False) -> Path | None:
    """Every file of the run of `trace` (its trace segments, checkpoints, summary, resolved
    config, logs and TensorBoard files) moved, intact, into a fresh `old-<time>/` of its
    folder (made with `folders.folder_mode`, renamed under checked folder descriptors).
    Returns that folder, None when there was nothing to move."""
    base = Path(os.path.abspath(trace))
    found = [*segments(base), *(p for s in _RUN_SUFFIXES
                                if os.path.lexists(p := base.with_suffix(s)))]
    if not found:
        return None
    fd = open_folder(base.parent, own=1, group_shared=group_shared)
    try:
        stamp = time.strftime("old-%Y%m%d-%H%M%S")
        name, n = stamp, 1
        while (dest := new_folder_at(fd, name, group_shared)) is None:
            name, n = f"{stamp}-{n}", n + 1
        try:
            for p in found:
                os.rename(p.name, p.name, src_dir_fd=fd, dst_dir_fd=dest)
        finally:
            os.close(dest)
    finally:
        os.close(fd)
    return base.parent / name


def complete(cfg) -> str | None:
    """The line for a run already done: `resume=auto` would start from a checkpoint of this
    config (the one the paradigm implies) that holds all rl.steps trained steps. None when
    there is more to do, or no such checkpoint (the preflight names what is wrong with one).
    Reads the checkpoint's state alone: a moment, before the task is built."""
    from pivotrl_hpc.checkpoint.folders import check_run
    from pivotrl_hpc.checkpoint.layout import CheckpointError, read_state
    from pivotrl_hpc.checkpoint.state import check_fixed, fixed_values
    from pivotrl_hpc.config.paradigm import normalize

    if cfg.resume not in (True, "auto"):
        return None
    try:
        check_run(cfg.trace.path, cfg.trace.group_shared)   # nothing read from a planted one
        if (ckpt := latest(root_for(cfg.trace.path))) is None:
            return None
        state = read_state(ckpt)
        check_fixed(state, fixed_values(normalize(cfg)), str(ckpt))
    except CheckpointError:
        return None
    step = state["step"]
    if step < cfg.rl.steps:
        return None
    return (f"{cfg.trace.path}: already complete at step {step} of {cfg.rl.steps} ({ckpt}); "
            f"nothing done. rl.steps=M with M > {step} continues it; resume={ASIDE} moves it "
            f"aside and starts afresh")


def continue_line(config: str, overrides: Sequence[str], trace: Path) -> str:
    """What a stopped `pivotrl run` prints last: its summary and the exact command that
    continues the run (the same config and overrides, resume=auto)."""
    import shlex
    import sys

    prog = sys.argv[0] if Path(sys.argv[0]).name == "pivotrl" else "pivotrl"
    kept = [o for o in overrides if o.partition("=")[0].strip() != "resume"]
    cmd = shlex.join([prog, "run", str(config), *kept, "resume=auto"])
    summary = trace.with_suffix(".summary.json")
    said = f"summary {summary}; " if summary.is_file() else ""
    if (ckpt := latest(root_for(trace))) is None:
        return (f"{said}no checkpoint was written (rl.checkpoint_every=N writes one every N "
                f"steps): {cmd} starts afresh")
    return f"{said}to continue from {ckpt.name}: {cmd}"


def forget_segments(trace: Path) -> None:
    """A fresh start rewrites the run's trace: later segments of an older run would follow
    it as if they continued it. Its checkpoints stay (new ones replace them step by step)."""
    for old in segments(trace)[1:]:
        old.unlink()
    if (ckpt := latest(root_for(trace))) is not None:
        log.warning("starting afresh (resume=false) in a run that holds checkpoints up to %s; "
                    "new ones replace them", ckpt.name)


_RUNNING: list = []   # the PreparedRuns `driving` holds: this process's srun jobs


@contextlib.contextmanager
def driving(run):
    """While the block runs, `checkpoint_now` asks `run` (a launch.local.PreparedRun, the
    newest one driven) for its checkpoint: submitit's timeout signal reaches the process
    that drives the job, not the job."""
    _RUNNING.append(run)
    try:
        yield run
    finally:
        _RUNNING.remove(run)


def checkpoint_now(wait_s: float) -> Path | None:
    """A checkpoint of the running job, now (submitit's timeout signal): ask for one after
    the next step and wait until it is whole, at most `wait_s`; the newest whole one."""
    if not _RUNNING:
        return None
    run = _RUNNING[-1]
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
    # temp + rename under the folder's fd: a planted link is replaced, never followed
    fd = open_folder(logs, own=2, group_shared=True)   # checked strictly at the start
    try:
        write_at(fd, REQUEST_FILE, mode + "\n")
    finally:
        os.close(fd)


MARKER = "job"   # in the logs folder: the job that last started in the run folder
_JOB_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.]{0,63}")   # launch.layout.job_id's alphabet


def previous_job(logs: Path, shared: bool = False) -> str:
    """The job id in the run folder's marker, if the marker is a regular file of this user
    holding a job id ("" otherwise, with a warning): its value names the files the sweep
    removes, so nothing else is taken from it (issue 46: `*` swept another job's files)."""
    try:
        fd = open_folder(logs, own=2, group_shared=shared)
    except FileNotFoundError:
        return ""
    try:
        text = read_own(fd, MARKER)
    finally:
        os.close(fd)
    old = (text or "").strip()
    if text is not None and not _JOB_ID.fullmatch(old):
        log.warning("ignored the job marker %s: %r is not a job id", logs / MARKER, old[:80])
        return ""
    if text is None and os.path.lexists(logs / MARKER):
        log.warning("ignored the job marker %s: not a regular file of this user", logs / MARKER)
    return old
