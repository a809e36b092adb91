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

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_ROOT = "runs"
JOB_NAME = "pivotrl"


def submit(config: str | Path, overrides: Sequence[str] = (), *, nodes: int | None = None,
           gpus_per_node: int | None = None, runs_root: str | Path = DEFAULT_ROOT,
           folder: str | Path | None = None, python: str | None = None, check: bool = True,
           cpus_per_gpu: int = 2, **slurm_options: Any):
    """Submit the RL job of `config` (+ dotted `overrides`); returns the submitit Job.

    nodes / gpus_per_node default to the config's cluster.nodes / devices_per_node. Every
    other keyword is a submitit Slurm parameter (partition, time in minutes, account,
    job_name, exclusive, constraint, qos, mem, additional_parameters, ...). With `check` the
    config is loaded and validated here first, so a typo fails at once rather than in the
    queue; the job checks it again, with the allocation, before any rank starts."""
    import submitit

    config = Path(config).resolve()
    if check:
        from pivotrl_hpc.config import load_config
        cfg = load_config(config, list(overrides))
        nodes = nodes or cfg.cluster.nodes
        gpus_per_node = gpus_per_node or cfg.cluster.devices_per_node
        _check_request(cfg, nodes, gpus_per_node)
    root = Path(runs_root).resolve()
    # `exec`: the interpreter becomes the batch shell, the one process B: signals reach, so
    # submitit's handler (and PivotJob.checkpoint) gets the timeout signal; behind bash it
    # would just kill bash
    executor = submitit.SlurmExecutor(folder=str(folder or root / "submitit"),
                                      python=f"exec {shlex.quote(python or sys.executable)}")
    # --cpus-per-gpu as a plain sbatch flag: submitit's own parameter wants --gpus-per-task.
    # submitit's timeout signal to the batch step only (B:), where it runs PivotJob and its
    # checkpoint(); Slurm's default would signal the ranks' step instead.
    delay = int(slurm_options.pop("signal_delay_s", 120))
    extra = {"cpus_per_gpu": cpus_per_gpu, "signal": f"B:USR2@{delay}",
             **slurm_options.pop("additional_parameters", {})}
    executor.update_parameters(**{
        "job_name": JOB_NAME, "nodes": nodes or 1, "ntasks_per_node": 1,
        "gres": f"gpu:{gpus_per_node or 1}", "additional_parameters": extra,
        "use_srun": False, "stderr_to_stdout": False, **slurm_options})
    return executor.submit(PivotJob(), str(config), tuple(overrides), root=str(root))


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
        checkpoint_now(float(os.environ.get("PIVOTRL_CHECKPOINT_WAIT_S", 60)))
        return DelayedSubmission(self, config, overrides, root=root)


def _check_request(cfg, nodes: int, gpus_per_node: int) -> None:
    """What the job would refuse once allocated, refused before it queues."""
    from pivotrl_hpc.launch.layout import LaunchError

    c = cfg.cluster
    if nodes != c.nodes:
        raise LaunchError(f"the config needs {c.nodes} node(s) (cluster.nodes) but "
                          f"{nodes} were asked for: submit with nodes={c.nodes}, or set "
                          f"cluster.nodes={nodes}")
    if gpus_per_node < c.devices_per_node:
        raise LaunchError(f"the config needs {c.devices_per_node} GPUs per node "
                          f"(cluster.devices_per_node) but {gpus_per_node} were asked for: "
                          f"submit with gpus_per_node={c.devices_per_node}, or set "
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
    if not os.environ.get("SLURM_CONF") and not Path("/etc/slurm/slurm.conf").exists():
        return "no Slurm configuration found (SLURM_CONF unset and no /etc/slurm/slurm.conf)"
    return None
