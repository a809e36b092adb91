"""The job inside a Slurm allocation. `slurm/pivot.sbatch` and `pivotrl_hpc.submit` (submitit)
both run, in the batch step,

    python -m pivotrl_hpc.launch.slurm CONFIG [key=value ...]

which reads the allocation (SLURM_* and `scontrol show job -d`), checks it against the config
before any rank starts (each refusal says what to change), writes the run folder
`<runs root>/<job name>-<job id>/` (default root: `runs` in the submit directory, or
PIVOTRL_RUNS_ROOT) with the resolved config, and starts the world as

    srun --mpi=pmix --nodes=N --ntasks-per-node=G+1 --distribution=block --gres=gpu:G \
        python -m pivotrl_hpc.launch.entry <run folder>/<name>.config.json

the same ranks and start-up as `pivotrl run` (layout.py, entry.py). scancel, the time limit
and preemption send SIGTERM to every task: the ranks stop in order (trace closed, segments
swept by each node's agent) within Slurm's KillWait (30 s by default; the ranks' own
watchdog is 20 s). Exit: 0 done, 1 a rank failed (named), 2 the allocation or the config
was refused, 128+signal stopped by a signal.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pivotrl_hpc import envs
from pivotrl_hpc.checkpoint.folders import create_in, take_own
from pivotrl_hpc.checkpoint.layout import REQUEUE_FILE, latest, root_for
from pivotrl_hpc.config import Config, load_config
from pivotrl_hpc.config.paradigm import normalize
from pivotrl_hpc.config.validate import check_cpu_shares
from pivotrl_hpc.gps import shmdir
from pivotrl_hpc.runtime import cgroup
from pivotrl_hpc.terminal import safe_logs
from pivotrl_hpc.launch.diagnose import BAD_INPUT, bad_input, diagnose, job_exit_code
from pivotrl_hpc.launch.layout import (LaunchError, RankLayout, RunPaths, expand_hostlist,
                                       job_ports)
from pivotrl_hpc.launch import mpi_private
from pivotrl_hpc.launch.local import (PreparedRun, StderrFollower, check_mpi, free_port_base,
                                      group_shared, preempt_grace, resolved_config, sweep_segments,
                                      write_files)
from pivotrl_hpc.launch.local import hold_gps_folder
from pivotrl_hpc.launch.resume import (absolute_resume, continue_in, driving, earlier_runs,
                                       request_checkpoint, requeueable, stop_grace)

log = logging.getLogger(__name__)

RUNS_ROOT_ENV = envs.RUNS_ROOT.name
ENTRY_ENV = envs.ENTRY.name   # the module every rank runs; tests swap in an MPI probe
ENTRY = envs.ENTRY.default
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class SlurmJobError(RuntimeError):
    """The job ran and failed; the message names the rank, its host, role and error."""


@dataclass(frozen=True)
class Allocation:
    job_id: str
    job_name: str
    nodes: tuple[str, ...]
    gpus: tuple[int, ...]      # per node, allocated
    cpus: tuple[int, ...]      # per node, allocated
    hosts: int                 # distinct machines behind the nodes (NodeAddr)
    submit_dir: Path

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Allocation":
        env = os.environ if env is None else env
        job = env.get("SLURM_JOB_ID")
        if not job:
            raise LaunchError("not inside a Slurm job: submit with `sbatch slurm/pivot.sbatch "
                              "CONFIG` or `pivotrl submit CONFIG`")
        nodes = tuple(expand_hostlist(env["SLURM_JOB_NODELIST"]))
        detail = parse_job_detail(_scontrol("show", "job", "-d", job))
        missing = [n for n in nodes if n not in detail]
        if missing:
            raise LaunchError(f"scontrol show job -d {job} lists no allocation for {missing}")
        return cls(job, env.get("SLURM_JOB_NAME", "pivotrl"), nodes,
                   tuple(detail[n][1] for n in nodes), tuple(detail[n][0] for n in nodes),
                   _distinct_hosts(nodes), Path(env.get("SLURM_SUBMIT_DIR", os.getcwd())))



def run_folder_name(job_name: str, job_id: str) -> str:
    """`<job name>-<job id>`, safe as one path component (also for `launch.submit`)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{job_name}-{job_id}")


def _scontrol(*args: str) -> str:
    p = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise LaunchError(f"scontrol {' '.join(args)} failed: {p.stderr.strip()}")
    return p.stdout


_DETAIL = re.compile(r"^\s+Nodes=(\S+) CPU_IDs=(\S+)(?:.*\bGRES=(\S+))?", re.M)


def parse_job_detail(text: str) -> dict[str, tuple[int, int]]:
    """`scontrol show job -d` -> node -> (CPUs, GPUs) allocated there, from lines like
    `Nodes=n[1-2] CPU_IDs=0-3 Mem=0 GRES=gpu:4(IDX:0-3)` (or `gpu:a100:4(...)`)."""
    out = {}
    for nodes, cpu_ids, gres in _DETAIL.findall(text):
        cpus = sum(int(hi or lo) - int(lo) + 1 for lo, hi in
                   re.findall(r"(\d+)(?:-(\d+))?", cpu_ids))
        m = re.search(r"gpu(?::[^:(,]+)?:(\d+)", gres or "")
        for node in expand_hostlist(nodes):
            out[node] = (cpus, int(m.group(1)) if m else 0)
    return out


def _distinct_hosts(nodes: tuple[str, ...]) -> int:
    """Machines behind the nodes: the local test cluster runs both of its nodes on one."""
    text = _scontrol("show", "node", "-o", ",".join(nodes))
    addrs = set(re.findall(r"\bNodeAddr=(\S+)", text))
    return max(1, len(addrs))


# ---- checks -----------------------------------------------------------------------------------
def check_allocation(cfg, alloc: Allocation) -> list[str]:
    """Refuse (LaunchError) an allocation the config cannot run on; return warnings."""
    c, job = cfg.cluster, alloc.job_id
    have, need = len(alloc.nodes), c.nodes
    if have != need:
        fewer = "only " if have < need else ""
        raise LaunchError(
            f"the config needs {need} node(s) (cluster.nodes) but job {job} has {fewer}"
            f"{have} ({','.join(alloc.nodes)}): submit with -N {need}, or set "
            f"cluster.nodes={have}")
    per_node = ", ".join(f"{n}: {g}" for n, g in zip(alloc.nodes, alloc.gpus))
    if len(set(alloc.gpus)) > 1:
        raise LaunchError(f"GPUs are split unevenly across nodes ({per_node}); request them "
                          f"per node with --gres=gpu:{c.devices_per_node} or "
                          f"--gpus-per-node={c.devices_per_node}, not --gpus=N")
    gpus = alloc.gpus[0]
    if gpus == 0:
        raise LaunchError(f"no GPUs allocated on {alloc.nodes[0]}; submit with "
                          f"--gres=gpu:{c.devices_per_node} or --gpus-per-node="
                          f"{c.devices_per_node}")
    if gpus < c.devices_per_node:
        raise LaunchError(f"the config needs {c.devices_per_node} GPUs per node "
                          f"(cluster.devices_per_node) but job {job} has {gpus} on each node: "
                          f"submit with --gres=gpu:{c.devices_per_node}, or set "
                          f"cluster.devices_per_node={gpus}")
    warnings = []
    if gpus > c.devices_per_node:
        warnings.append(f"{gpus - c.devices_per_node} of the {gpus} GPUs per node stay idle "
                        f"(cluster.devices_per_node={c.devices_per_node})")
    tasks = c.devices_per_node + 1
    short = [(n, k) for n, k in zip(alloc.nodes, alloc.cpus) if k < tasks]
    if short:
        n, k = short[0]
        raise LaunchError(f"{tasks} tasks per node (1 GPS agent + {c.devices_per_node} device "
                          f"workers) need {tasks} CPUs but node {n} has {k}: submit with "
                          f"--cpus-per-gpu=2 (pivot.sbatch's default), --cpus-per-task, "
                          f"or --exclusive")
    return warnings


def runs_root(env: Mapping[str, str], alloc: Allocation, root: str | Path | None) -> Path:
    root = Path(root or envs.RUNS_ROOT.get(env))
    return root if root.is_absolute() else alloc.submit_dir / root


def prepare(cfg, alloc: Allocation, *, root: str | Path | None = None,
            env: Mapping[str, str] | None = None) -> PreparedRun:
    """Every check that needs no rank (config and allocation, CPU shares, cgroups); the run
    folder and the srun command. Raises ConfigError / LaunchError / CgroupError."""
    env = os.environ if env is None else env
    cfg = normalize(cfg)
    warnings = check_allocation(cfg, alloc)
    share = check_cpu_shares(cfg, os.cpu_count() or 1, alloc.hosts)
    if cgroup.caps_enabled(cfg, env):
        cgroup.check_writable(alloc.job_id)
    layout = RankLayout(cfg.cluster.nodes, cfg.cluster.devices_per_node, alloc.nodes)
    trace = continue_in(cfg.resume)     # resume=PATH: that run's folder, continued
    if trace is None:
        folder = runs_root(env, alloc, root) / run_folder_name(alloc.job_name, alloc.job_id)
        trace = folder / Path(cfg.trace.path).name
        note = earlier_runs(folder.parent, alloc.job_name, trace.name, folder)
        if note and latest(root_for(trace)) is None:   # (a requeued job has its own)
            warnings.append(note)
    config, paths = resolved_config(cfg, trace)
    run_env = {envs.PORT_BASE.name: str(free_port_base(job_ports(len(layout.devices)))),
               envs.GPS_DIR.name: str(shmdir.SHM_DIR),   # one folder name on every node
               "OMP_NUM_THREADS": envs.OMP_NUM_THREADS.get(env),
               # Open MPI's files in a 0700 folder each node's ranks make, the training
               # world's store in the run's logs folder (launch/mpi_private.py)
               **mpi_private.job_env(alloc.job_id, paths.logs)}
    check_mpi(run_env)
    cpus = min(alloc.cpus) // layout.ranks_per_node
    command = srun_command(layout, alloc.gpus[0], cpus, paths.config_json,
                           entry=envs.ENTRY.get(env))
    warning = "; ".join([*warnings, *([share] if share else [])]) or None
    return PreparedRun(layout, paths, alloc.job_id, run_env, command, config, warning)


def srun_command(layout: RankLayout, gpus: int, cpus_per_task: int, config_json: Path,
                 python: str | None = None, entry: str = ENTRY) -> list[str]:
    # --gres explicitly: by default a step gets the job's *requested* GPUs, fewer than
    # allocated under --exclusive. Every task sees all of its node's; a worker picks its own
    # by local rank (runtime.spec).
    return ["srun", "--mpi=pmix", f"--nodes={layout.nodes}", f"--ntasks={layout.world_size}",
            f"--ntasks-per-node={layout.ranks_per_node}", "--distribution=block",
            f"--gres=gpu:{gpus}", f"--cpus-per-task={cpus_per_task}", "--kill-on-bad-exit=1",
            python or sys.executable, "-m", entry, str(config_json)]


# ---- run --------------------------------------------------------------------------------------
@dataclass
class Outcome:
    code: int                  # 0 done, 1 failed, 128+signal stopped
    message: str
    paths: RunPaths
    summary: dict | None = None


class _Stop:
    """The batch step's stop signal: remembered, passed on to srun once (srun forwards it to
    every task; tasks that also got it from Slurm count it once). SIGUSR1 (pivot.sbatch's
    `--signal=B:USR1@...` before the time limit) asks the controller for a checkpoint after
    the next step and a requeue (a request file it polls)."""

    def __init__(self, logs: Path | None = None, job: str | None = None):
        self.signum: int | None = None
        self.proc: subprocess.Popen | None = None
        self.logs, self.job = logs, job
        self._old = {}

    def __enter__(self) -> "_Stop":
        for sig in STOP_SIGNALS:
            self._old[sig] = signal.signal(sig, self._on_signal)
        if self.logs is not None:
            self._old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_usr1)
        return self

    def _on_usr1(self, _signum, _frame) -> None:
        requeue = self.job is not None and requeueable(self.job)
        log.warning("got SIGUSR1 (time limit near): checkpoint after the next step%s",
                    ", then requeue" if requeue else " (the job may not be requeued: it "
                    "goes on; resubmit with resume=<checkpoint> to continue)")
        request_checkpoint(self.logs, "requeue" if requeue else "checkpoint")

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _on_signal(self, signum, _frame) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        log.warning("got %s: the ranks stop in order", signal.Signals(signum).name)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


def execute(run: PreparedRun, *, grace_s: float = 40.0) -> Outcome:
    """Start srun, wait for it, clean up this node, name the failure."""
    write_files(run)
    print(f"pivotrl: job {run.job}: {run.layout.world_size} ranks on "
          f"{','.join(run.layout.node_names)}; run folder {run.paths.trace.parent}", flush=True)
    if run.cpu_warning:
        print(f"pivotrl: warning: {run.cpu_warning}", flush=True)
    shared = group_shared(run.config)
    (run.paths.logs / REQUEUE_FILE).unlink(missing_ok=True)   # a stale one: not this start's
    gps = hold_gps_folder()
    text = ""
    with _Stop(run.paths.logs, run.job) as stop, driving(run):
        if stop.signum is None:
            # made fresh in the checked logs folder, followed through its descriptor
            err = create_in(run.paths.logs, "srun.log", shared, own=2)
            try:
                stop.proc = subprocess.Popen(run.command, stderr=err,
                                             env={**os.environ, **run.env})
                follower = StderrFollower(stop.proc, Path(f"/proc/self/fd/{err}"))
                _wait(stop, stop_grace(grace_s, preempt_grace(run), 30.0))
                follower.join()
                text = follower.text()
            finally:
                os.close(err)
    rc = stop.proc.returncode if stop.proc is not None else None
    cleanup(run, failed=stop.signum is None and rc != 0)
    shmdir.release(gps)
    if stop.signum is not None:
        return Outcome(128 + stop.signum, f"stopped by {signal.Signals(stop.signum).name}; "
                       f"trace {run.paths.trace}", run.paths, _summary(run.paths))
    # the controller's marker: used only if it is a regular file of this user (a planted
    # one, or a FIFO, is removed and ignored with a warning: folders.take_own)
    marker = take_own(run.paths.logs, REQUEUE_FILE, group_shared=shared) if rc == 0 else None
    if marker is not None:
        return requeue(run, marker)
    if rc == 0:
        summary = _summary(run.paths)
        return Outcome(0, f"done; summary {run.paths.summary_json}" if summary is not None
                       else "done (the controller returned no summary)", run.paths, summary)
    return Outcome(job_exit_code(run.paths), diagnose(run.layout, run.paths, text, rc, "srun"),
                   run.paths)


def requeue(run: PreparedRun, marker: str) -> Outcome:
    """The controller checkpointed and stopped for a requeue (`marker`: its requeue file's
    text): put the job back in the queue; it resumes in the same run folder (same job id)
    from that checkpoint."""
    try:
        info = json.loads(marker)
        info = {"step": int(info["step"]), "checkpoint": str(info["checkpoint"]),
                "why": str(info.get("why", ""))}
    except (ValueError, TypeError, KeyError):
        return Outcome(1, f"{run.paths.logs / REQUEUE_FILE} holds no requeue marker "
                       f"({marker[:60]!r}): not requeued", run.paths, _summary(run.paths))
    why = "after a stop signal" if info.get("why") == "stop" else "before the time limit"
    done = f"checkpointed at step {info['step']} {why} ({info['checkpoint']})"
    if info.get("why") == "stop" and not requeueable(run.job):
        return Outcome(0, f"{done}; the job may not be requeued: submit again with "
                       f"resume={info['checkpoint']} to continue", run.paths, _summary(run.paths))
    # the requeue SIGTERMs this batch step at once: ignored, so that main's line reporting it
    # is written (it was lost under load); the step ends right after that line
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    p = subprocess.run(["scontrol", "requeue", run.job], capture_output=True, text=True,
                       timeout=60, check=False)
    if p.returncode != 0:
        signal.signal(signal.SIGTERM, before)
        return Outcome(1, f"{done}, but `scontrol requeue {run.job}` failed: "
                       f"{p.stderr.strip() or p.stdout.strip()}; submit again with "
                       f"resume={info['checkpoint']} to continue", run.paths, _summary(run.paths))
    return Outcome(0, f"{done}; job {run.job} requeued: it resumes from there", run.paths,
                   _summary(run.paths))


def _wait(stop: _Stop, grace_s: float) -> None:
    while stop.proc.poll() is None:
        time.sleep(0.2)
        if stop.signum is not None:
            try:
                stop.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.error("ranks still running %.0f s after the stop signal: killing srun",
                          grace_s)
                stop.proc.kill()
                stop.proc.wait()
            return


def _summary(paths: RunPaths) -> dict | None:
    try:
        return json.loads(paths.summary_json.read_text())
    except FileNotFoundError:
        return None


def cleanup(run: PreparedRun, failed: bool) -> None:
    """What killed ranks left: this node's segments and cgroups, and, after a failure, the
    other nodes' segments (one task per node; not after a stop signal: no new step can start
    while Slurm stops the job, and an orderly stop leaves nothing)."""
    mpi_private.remove_all(run.env)   # this node's MPI folder, the training world's store
    removed = sweep_segments(run.job)
    if removed:
        log.warning("removed %d GPS segment(s) the ranks left: %s", len(removed), removed)
    cgroup.remove_job(run.job, wait_s=10.0)
    if failed and run.layout.nodes > 1:
        code = ("from pivotrl_hpc.launch.local import sweep_segments as s; "
                f"print(len(s({run.job!r}) or ''))")
        subprocess.run(["srun", f"--nodes={run.layout.nodes}", "--ntasks-per-node=1",
                        "--overlap", sys.executable, "-c", code], capture_output=True,
                       timeout=60, check=False, env={**os.environ, **run.env})


def load_for(alloc: Allocation, config: str | Path, overrides) -> Config:
    """The config checked against the allocation first (a moment), then by the preflight
    (~3.6 CPU-s: it builds the RL task): a wrong allocation is refused before that work."""
    from pivotrl_hpc.launch.preflight import preflight_slurm

    cfg = load_config(config, absolute_resume(overrides, alloc.submit_dir))
    check_allocation(cfg, alloc)         # cfg.cluster only, which normalize keeps
    preflight_slurm(cfg)   # its run folder is runs/<name>-<id>/, not the local trace.path
    return cfg


# ---- the two ways in --------------------------------------------------------------------------
def run_in_allocation(config: str | Path, overrides: tuple[str, ...] | list[str] = (), *,
                      root: str | Path | None = None) -> dict:
    """What `pivotrl_hpc.submit` runs in the batch step: the job's summary, with `trace`,
    `run_folder` and `job_id` added. Raises ConfigError / LaunchError (refused before any rank
    started), SlurmJobError (a rank failed, named) or InterruptedError (stopped by a signal)."""
    _log_to_stderr()
    alloc = Allocation.from_env()
    run = prepare(load_for(alloc, config, overrides), alloc, root=root)
    out = execute(run)
    if out.code == 0 and out.summary is not None:
        return {**out.summary, "trace": str(out.paths.trace),
                "run_folder": str(out.paths.trace.parent), "job_id": run.job}
    if out.code > 128:
        raise InterruptedError(f"job {run.job} {out.message}")
    raise SlurmJobError(f"job {run.job}: {out.message}")


def main(argv: list[str] | None = None) -> int:
    """`python -m pivotrl_hpc.launch.slurm CONFIG [key=value ...]` (pivot.sbatch's body)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print("usage: python -m pivotrl_hpc.launch.slurm CONFIG [key=value ...] (inside a "
              "Slurm allocation; see slurm/pivot.sbatch)", file=sys.stderr)
        return 2
    _log_to_stderr()
    try:
        alloc = Allocation.from_env()
        run = prepare(load_for(alloc, argv[0], argv[1:]), alloc)
    except BAD_INPUT as e:
        print(f"pivot.sbatch: error: {bad_input(e, argv[0])}", file=sys.stderr)
        return 2
    out = execute(run)
    print(f"pivotrl: {out.message}", file=sys.stderr if out.code else sys.stdout, flush=True)
    return out.code


def _log_to_stderr() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s pivotrl %(levelname)s %(message)s")
        safe_logs()


if __name__ == "__main__":
    sys.exit(main())
