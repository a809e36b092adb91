"""`pivotrl_hpc.submit(config, **slurm_options)` and `pivotrl submit`: the Slurm job from a
Python session, through submitit.

submitit writes and submits an sbatch script whose batch step (`use_srun=False`) runs
`launch.slurm.run_in_allocation` — the body of `slurm/pivot.sbatch` — so both ways in check
the allocation and start the world (`srun --mpi=pmix`) with the same code. `job.result()` is
the run summary with `trace`, `run_folder` and `job_id`; a refused allocation or config
raises with its message, a failed rank raises `SlurmJobError` naming it (submitit wraps both
in its `FailedJobError`, whose text carries ours). submitit's own logs go to
`<runs root>/submitit/<job id>_0_log.{out,err}`.
"""
from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pivotrl_hpc import envs
from pivotrl_hpc.launch.partition import DEFAULT_TIME_MIN

DEFAULT_ROOT = "runs"
JOB_NAME = "pivotrl"


def submit(config: str | Path, overrides: Sequence[str] = (), *, nodes: int | None = None,
           gpus_per_node: int | None = None, runs_root: str | Path = DEFAULT_ROOT,
           folder: str | Path | None = None, python: str | None = None, check: bool = True,
           cpus_per_gpu: int = 2, **slurm_options: Any):
    """Submit the RL job of `config` (+ dotted `overrides`); returns the submitit Job, with
    `job.pivotrl` (a `Submitted`: time limit, requeue lead) added.

    nodes / gpus_per_node default to the config's cluster.nodes / devices_per_node. `time`
    (minutes) defaults to DEFAULT_TIME_MIN (a day), or the partition's MaxTime when shorter;
    the job checkpoints and requeues itself `signal_delay_s` (120) before it. Every other
    keyword is a submitit Slurm parameter (partition, account, job_name, exclusive,
    constraint, qos, mem, additional_parameters, ...). With `check` the config is loaded and
    validated here first, and the request is checked against the partition, so a typo or a
    request that would pend forever fails at once rather than in the queue; the job checks
    the config again, with the allocation, before any rank starts. A relative `resume=PATH`
    is taken from the current folder (the job's submit directory)."""
    from pivotrl_hpc.launch.layout import LaunchError
    from pivotrl_hpc.launch.resume import absolute_resume, continue_in

    if (note := environment_note()) is not None:   # as `pivotrl submit` refuses
        raise LaunchError(note)
    config = Path(config).resolve()
    overrides = absolute_resume(overrides, Path.cwd())
    asked = time_min = slurm_options.pop("time", None)
    if check:
        from pivotrl_hpc.config import load_config
        from pivotrl_hpc.launch.preflight import preflight_slurm
        from pivotrl_hpc.launch.partition import check_request, default_time, query
        cfg = load_config(config, list(overrides))
        preflight_slurm(cfg)
        nodes = nodes or cfg.cluster.nodes
        gpus_per_node = gpus_per_node or cfg.cluster.devices_per_node
        _check_request(cfg, nodes, gpus_per_node)
        continue_in(cfg.resume)     # resume=PATH: a whole checkpoint there, or refused now
        part = query(slurm_options.get("partition"))
        time_min = time_min or default_time(part)
        check_request(part, nodes, gpus_per_node, cpus_per_gpu * gpus_per_node, time_min)
    info = Submitted(int(time_min or DEFAULT_TIME_MIN), not asked,
                     int(slurm_options.pop("signal_delay_s", 120)))
    root = Path(runs_root).resolve()
    executor = _executor(Path(folder or root / "submitit"), python)
    # --cpus-per-gpu as a plain sbatch flag: submitit's own parameter wants --gpus-per-task.
    # submitit's timeout signal to the batch step only (B:), where it runs PivotJob and its
    # checkpoint(); Slurm's default would signal the ranks' step instead. --nodes as a plain
    # flag too: submitit counts a task per node and waits for each one's result, but only
    # the batch step (one task, whatever the nodes) runs PivotJob.
    extra = {"cpus_per_gpu": cpus_per_gpu, "signal": f"B:USR2@{info.signal_delay_s}",
             "nodes": nodes or 1, **slurm_options.pop("additional_parameters", {})}
    executor.update_parameters(**{
        "job_name": JOB_NAME, "ntasks_per_node": 1, "time": info.time_min,
        "gres": f"gpu:{gpus_per_node or 1}", "additional_parameters": extra,
        "use_srun": False, "stderr_to_stdout": False, **slurm_options})
    job = _submit(executor, PivotJob(), str(config), tuple(overrides), root=str(root))
    job.pivotrl = info
    return job


@dataclass(frozen=True)
class Submitted:
    time_min: int           # the job's time limit
    time_default: bool      # ... chosen here (no `time` asked for)
    signal_delay_s: int     # the checkpoint-and-requeue signal comes this long before it

    def describe(self) -> str:
        h, m = divmod(self.time_min, 60)
        how = "the default; --time sets it" if self.time_default else "asked for"
        return (f"time limit {h}:{m:02d}:00 ({how}); {self.signal_delay_s} s before it the "
                f"job checkpoints and requeues itself")


def _executor(folder: Path, python: str | None):
    """A SlurmExecutor whose jobs have one task: the batch step (use_srun=False)."""
    import submitit

    class BatchStepExecutor(submitit.SlurmExecutor):
        def _num_tasks(self) -> int:
            return 1

    # `exec`: the interpreter becomes the batch shell, the one process B: signals reach, so
    # submitit's handler (and PivotJob.checkpoint) gets the timeout signal; behind bash it
    # would just kill bash
    return BatchStepExecutor(folder=str(folder),
                             python=f"exec {shlex.quote(python or sys.executable)}")


def _submit(executor, *args, **kwargs):
    """executor.submit; sbatch's refusal as one LaunchError line, leaving no file behind
    (submitit keeps the job's pickle and script, and prints sbatch's stderr itself)."""
    import contextlib
    import io

    from submitit.core.utils import FailedJobError

    from pivotrl_hpc.launch.layout import LaunchError

    folder = Path(executor.folder)
    before = set(folder.iterdir()) if folder.is_dir() else None
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return executor.submit(*args, **kwargs)
    except FailedJobError as e:
        for f in (set(folder.iterdir()) - (before or set())) if folder.is_dir() else ():
            f.unlink()
        if before is None and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        why = next((line for line in lines if "error" in line.lower()), lines[-1] if lines
                   else "no message")
        raise LaunchError(f"sbatch refused the job: {why}") from None


class PivotJob:
    """What submitit runs in the batch step: `launch.slurm.run_in_allocation`. On submitit's
    timeout or preemption signal (`signal_delay_s` before the kill) `checkpoint()` asks the
    controller for a checkpoint after its next step, waits for it (at most
    PIVOTRL_CHECKPOINT_WAIT_S, 60 s), and hands submitit the same call, which it requeues:
    the job comes back with its job id, so in its run folder, and resumes from there."""

    def __call__(self, config: str, overrides: tuple[str, ...], root: str) -> dict:
        from pivotrl_hpc.launch.slurm import run_in_allocation
        return run_in_allocation(config, overrides, root=root)

    def checkpoint(self, config: str, overrides: tuple[str, ...], root: str):
        from submitit.helpers import DelayedSubmission

        from pivotrl_hpc.launch.resume import checkpoint_now
        checkpoint_now(envs.CHECKPOINT_WAIT_S.get())
        return DelayedSubmission(self, config, overrides, root=root)


def _check_request(cfg, nodes: int, gpus_per_node: int) -> None:
    """What the job would refuse once allocated, refused before it queues."""
    from pivotrl_hpc.launch.layout import LaunchError

    c = cfg.cluster
    if nodes != c.nodes:
        raise LaunchError(f"the config needs {c.nodes} node(s) (cluster.nodes) but "
                          f"{nodes} were asked for: submit with --nodes {c.nodes} (nodes="
                          f"{c.nodes} from Python), or set cluster.nodes={nodes}")
    if gpus_per_node < c.devices_per_node:
        raise LaunchError(f"the config needs {c.devices_per_node} GPUs per node "
                          f"(cluster.devices_per_node) but {gpus_per_node} were asked for: "
                          f"submit with --gpus-per-node {c.devices_per_node} (gpus_per_node="
                          f"{c.devices_per_node} from Python), or set "
                          f"cluster.devices_per_node={gpus_per_node}")


def run_folder(job, runs_root: str | Path = DEFAULT_ROOT, job_name: str = JOB_NAME) -> Path:
    """Where the job's trace, summary and logs go (known once it is submitted)."""
    from pivotrl_hpc.launch.slurm import run_folder_name

    return Path(runs_root).resolve() / run_folder_name(job_name, job.job_id)


def environment_note() -> str | None:
    """submitit submits with the sbatch on PATH; say so when there is none."""
    from shutil import which

    if which("sbatch") is None:
        return "sbatch is not on PATH: run this on a Slurm login node (or load the Slurm module)"
    if not envs.SLURM_CONF.is_set() and not Path("/etc/slurm/slurm.conf").exists():
        return "no Slurm configuration found (SLURM_CONF unset and no /etc/slurm/slurm.conf)"
    return None
