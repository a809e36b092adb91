"""`pivotrl run` on one machine: checks, run files, mpirun, signal forwarding, diagnosis.

`prepare` does every check that needs no process (config, CPU shares, cgroups, mpirun on
PATH) and builds the command; `launch` writes the resolved config next to the trace, starts

    mpirun --oversubscribe --allow-run-as-root --bind-to none -n N*(G+1) -x ... \
        python -m pivotrl_hpc.launch.entry out/<name>.config.json

in its own session (a terminal's Ctrl-C reaches only this process; its stderr goes to
mpirun.log, a file, so mpirun never dies of SIGPIPE), and waits. A stop signal (SIGINT,
SIGTERM, SIGHUP) is forwarded as SIGTERM to every rank (their pids are in the run folder), as
scancel does under Slurm, so the ranks stop in order (entry.py); a second signal, or ranks
still alive `grace_s` later, kill the job. If this process dies (even by SIGKILL) the ranks
notice (PIVOTRL_LAUNCHER_PID) and stop as on SIGTERM. mpirun itself aborts the whole job within a
second or two when a rank dies or calls MPI Abort (ranks then get SIGTERM and
`odls_base_sigkill_timeout` seconds before SIGKILL). Afterwards the launcher sweeps the job's
segments from /dev/shm and its cgroups, whatever happened, and names the failing rank (from
rank-N.error.json, else mpirun's message) with its host, role and error.

Open MPI's shared memory and session files, and the training world's rendezvous, live in
fresh 0700 folders of the job made before mpirun starts and removed after it
(launch/mpi_private.py); a job whose settings would put them in a shared folder is refused.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pivotrl_hpc import envs
from pivotrl_hpc.checkpoint.folders import RunFolderError, check_run, create_in, write_text
from pivotrl_hpc.config import to_dict
from pivotrl_hpc.config.validate import check_cpu_shares
from pivotrl_hpc.engines import ports
from pivotrl_hpc.gps import shmdir
from pivotrl_hpc.runtime import cgroup
from pivotrl_hpc.launch.diagnose import diagnose as diagnose_ranks, job_exit_code
from pivotrl_hpc.config.paradigm import normalize
from pivotrl_hpc.launch import mpi_private
from pivotrl_hpc.launch.layout import LaunchError, RankLayout, RunPaths, job_ports
from pivotrl_hpc.launch.resume import (ASIDE, MARKER, check_owner, move_aside, previous_job,
                                       stop_grace)

log = logging.getLogger(__name__)

SIGKILL_TIMEOUT_S = 5   # mpirun's SIGTERM -> SIGKILL delay when it aborts a job
FORWARDED_ENV = (envs.CONTROLLER.name, envs.LOG_LEVEL.name, envs.STOP_GRACE_S.name,
                 envs.SHUTDOWN_TIMEOUT_S.name, envs.SHM_DIR.name, shmdir.FOLDER_ENV,
                 cgroup.ROOT_ENV, "PYTHONPATH", "VLLM_LOGGING_LEVEL")
_RANK_LINE = re.compile(r" r(\d+) \S+ (agent|worker)")


@dataclass(frozen=True)
class PreparedRun:
    """A job checked and ready to start: its layout, run files, env and launcher command
    (mpirun here; srun in slurm.py)."""
    layout: RankLayout
    paths: RunPaths
    job: str
    env: dict[str, str]          # set for (and exported to) every rank
    command: list[str]
    config: dict = field(repr=False)
    cpu_warning: str | None = None

    def shell_line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{env} {shlex.join(self.command)}"


def prepare(cfg, *, cpu_cap: bool = True, cores: int | None = None,
            job: str | None = None) -> PreparedRun:
    """Every check that needs no process; raises ConfigError / LaunchError / CgroupError.
    The paradigm's implications (colocated: training on every device, staleness 0) are
    applied here, so the ranks read one resolved config."""
    cfg = normalize(cfg)
    warning = check_cpu_shares(cfg, cores or os.cpu_count() or 1)
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise LaunchError("mpirun is not on PATH: apt-get install openmpi-bin (or load your "
                          "site's Open MPI module)")
    job = job or f"run{uuid.uuid4().hex[:8]}"
    layout = RankLayout.from_config(cfg, {})
    env = {envs.RUN_ID.name: job, envs.NODE_NAMES.name: ",".join(layout.node_names),
           envs.PORT_BASE.name: str(free_port_base(
               job_ports(layout.nodes * layout.devices_per_node))),
           "UCX_MODULES": envs.UCX_MODULES.get(),
           "OMP_NUM_THREADS": envs.OMP_NUM_THREADS.get(),
           "GLOO_SOCKET_IFNAME": "lo"}   # the training world's gloo pairs: one machine
    env.update({k: os.environ[k] for k in FORWARDED_ENV if k in os.environ})
    env[shmdir.FOLDER_ENV] = str(shmdir.SHM_DIR)   # every rank, this launcher's sweep: one folder
    if not cpu_cap:
        env[cgroup.OPT_OUT_ENV] = "off"
    if cgroup.caps_enabled(cfg, env):
        cgroup.check_writable(job)
    config, paths = resolved_config(cfg, Path(cfg.trace.path))
    check_owner(cfg.resume, paths.trace)   # resume=false over an earlier run: refused
    env.update(mpi_private.job_env(job, paths.logs))   # MPI's files, the training store
    check_mpi(env)
    command = mpirun_command(mpirun, layout, paths.config_json, sorted(env))
    return PreparedRun(layout, paths, job, env, command, config, warning)


def resolved_config(cfg, trace: Path) -> tuple[dict, RunPaths]:
    """The config every rank reads (as a dict) with its trace at `trace`, and the run files
    next to that trace."""
    config = to_dict(cfg)
    config["trace"]["path"] = str(trace.resolve())
    paths = RunPaths(Path(config["trace"]["path"]))
    try:   # before any work: a folder another account could plant in (issue 46)
        check_run(paths.trace, group_shared(config))
    except RunFolderError as e:
        raise LaunchError(f"run folder: {e}") from None
    return config, paths


def check_mpi(env: dict[str, str]) -> None:
    """Refuse before any work if Open MPI would put a segment in a shared folder."""
    try:
        mpi_private.settings(env)
    except mpi_private.MPIFolderError as e:
        raise LaunchError(str(e)) from None


def group_shared(config: dict) -> bool:
    return bool(config.get("trace", {}).get("group_shared", False))


def mpirun_command(mpirun: str, layout: RankLayout, config_json: Path,
                   exported: list[str]) -> list[str]:
    # Every rank is on this machine: Open MPI's out-of-band and TCP transport listen on
    # loopback only, not on every interface another host could reach (issue 46)
    cmd = [mpirun, "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
           "--mca", "odls_base_sigkill_timeout", str(SIGKILL_TIMEOUT_S),
           "--mca", "oob_tcp_if_include", "lo", "--mca", "btl", "self,vader",
           "-n", str(layout.world_size)]
    for name in exported:
        cmd += ["-x", name]
    return cmd + [sys.executable, "-m", "pivotrl_hpc.launch.entry", str(config_json)]


def free_port_base(count: int) -> int:
    """A base port with `count` free ports above it, outside the ephemeral range (engines.ports)."""
    try:
        return ports.free_port_base(count)
    except OSError as e:
        raise LaunchError(str(e)) from None


# ---- run ---------------------------------------------------------------------------
def write_files(run: PreparedRun) -> None:
    """The resolved config and a run folder of this start's files only (an earlier start's
    logs moved to logs/start-K/, its summary removed)."""
    shared = group_shared(run.config)
    try:   # made (0755) and checked level by level without following links (issue 46)
        check_run(run.paths.trace, shared, create=True)
    except RunFolderError as e:
        raise LaunchError(f"run folder: {e}") from None
    sweep_killed_job(run)
    if run.config.get("resume") == ASIDE and \
            (aside := move_aside(run.paths.trace, shared)) is not None:
        log.warning("resume=%s: the earlier run of %s moved to %s; starting afresh", ASIDE,
                    run.paths.trace.name, aside)
        check_run(run.paths.trace, shared, create=True)
    write_text(run.paths.logs, MARKER, f"{run.job}\n", shared, own=2)
    try:   # fresh 0700 folders: Open MPI's files, the training world's store
        mpi_private.make(run.env, shared)
    except (mpi_private.MPIFolderError, RunFolderError, OSError) as e:
        raise LaunchError(f"the job's private folders: {e}") from None
    run.paths.keep_previous_logs()
    run.paths.summary_json.unlink(missing_ok=True)
    write_text(run.paths.trace.parent, run.paths.config_json.name,
               json.dumps(run.config, indent=1) + "\n", shared)


def hold_gps_folder() -> int:
    """The user's GPS folder, as published to the ranks, made and held (a shared flock) by the
    launcher while the job runs: the last agent of another job of the user cannot remove it
    (freeing its name for another account to take) before this job's agents hold it."""
    try:
        return shmdir.hold()
    except shmdir.FolderRefused as e:
        raise LaunchError(str(e)) from None


def preempt_grace(run: PreparedRun) -> float:
    return float(run.config.get("rl", {}).get("preempt_grace_s", 0.0))


def launch(run: PreparedRun, *, grace_s: float = 30.0) -> int:
    """Run the job; return 0, 128+signal when stopped by a signal, 1 when it failed."""
    write_files(run)
    log.info("run %s: %d ranks, logs in %s", run.job, run.layout.world_size, run.paths.logs)
    gps = hold_gps_folder()
    forwarder = SignalForwarder(run, stop_grace(grace_s, preempt_grace(run), 20.0))
    forwarder.install()
    try:
        # stderr into a file, not a pipe: mpirun must outlive this process (SIGPIPE would
        # kill it mid-abort and orphan the ranks before they clean up); made fresh in the
        # checked logs folder (a planted link of its name replaced, never followed) and
        # followed through this process's descriptor of it, not by name
        err = create_in(run.paths.logs, "mpirun.log", group_shared(run.config), own=2)
        try:
            proc = subprocess.Popen(_with_launcher_pid(run.command), stderr=err,
                                    start_new_session=True,
                                    env={**os.environ, **run.env,
                                         envs.LAUNCHER_PID.name: str(os.getpid())})
        except BaseException:
            os.close(err)
            raise
    except BaseException:
        forwarder.uninstall()
        raise
    forwarder.started(proc)
    stderr = StderrFollower(proc, Path(f"/proc/self/fd/{err}"))
    try:
        while proc.poll() is None:
            time.sleep(0.1)
            forwarder.tick()
    finally:
        forwarder.uninstall()
        stderr.join()
        os.close(err)
        cleanup(run)
        shmdir.release(gps)   # the folder too, once no agent holds it
    if forwarder.signum is not None:
        when = " during start-up" if forwarder.during_startup else ""
        trace = f"trace {run.paths.trace}, " if run.paths.trace.exists() else ""
        print(f"pivotrl run: stopped by {signal.Signals(forwarder.signum).name}{when}; "
              f"{trace}logs {run.paths.logs}", file=sys.stderr)
        return 128 + forwarder.signum
    if proc.returncode == 0:
        print(f"summary: {run.paths.summary_json}" if run.paths.summary_json.is_file()
              else "pivotrl run: done (the controller returned no summary)")
        return 0
    print(f"pivotrl run: {diagnose(run, stderr.text(), proc.returncode)}", file=sys.stderr)
    return job_exit_code(run.paths)


def _with_launcher_pid(command: list[str]) -> list[str]:
    """Export this process's pid to the ranks: they stop if `pivotrl run` dies (entry.py)."""
    i = command.index(sys.executable)
    return [*command[:i], "-x", envs.LAUNCHER_PID.name, *command[i:]]


class StderrFollower:
    """Follows mpirun.log (mpirun's stderr) while mpirun runs; echoes rank lines (errors,
    tagged with the rank) live."""

    def __init__(self, proc: subprocess.Popen, path: Path):
        self.lines: list[str] = []
        self._path = path
        self._thread = threading.Thread(target=self._follow, args=(proc,), daemon=True)
        self._thread.start()

    def _follow(self, proc: subprocess.Popen) -> None:
        with open(self._path, errors="replace") as f:
            while True:
                running = proc.poll() is None
                line = f.readline()
                while line:
                    self.lines.append(line)
                    if _RANK_LINE.search(line):
                        sys.stderr.write(line)
                    line = f.readline()
                if not running:
                    return
                time.sleep(0.1)

    def join(self) -> None:
        self._thread.join(10)

    def text(self) -> str:
        return "".join(self.lines)


class SignalForwarder:
    def __init__(self, run: PreparedRun, grace_s: float):
        self.run, self.grace_s = run, grace_s
        self.proc: subprocess.Popen | None = None
        self.signum: int | None = None
        self.deadline: float | None = None
        self.first_at = 0.0
        self.during_startup: bool | None = None   # judged once, at the first tick after it
        self._old: dict[int, object] = {}

    def started(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        if self.signum is not None:   # a signal came while mpirun was being started
            self._forward()

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _on_signal(self, signum, _frame) -> None:
        if self.signum is not None:
            # a second signal (Ctrl-C again) stops at once; one sent to the whole process
            # group (`timeout`, a shell) arrives twice within a moment and is not a second
            if time.monotonic() - self.first_at > 1.0:
                self.kill("second signal")
            return
        self.signum, self.first_at = signum, time.monotonic()
        self.deadline = self.first_at + self.grace_s
        if self.proc is not None:
            self._forward()

    def _forward(self) -> None:
        pids = rank_pids(self.run)
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        if len(pids) < self.run.layout.world_size:   # some ranks not up yet: mpirun ends them
            _signal(self.proc.pid, signal.SIGTERM)

    def tick(self) -> None:
        if self.deadline is not None and self.during_startup is None:
            # no step trained yet: nothing to keep, so the job ends in seconds, quietly
            # (ranks building engines would only time out one by one)
            self.during_startup = starting(self.run.paths.trace)
            if self.during_startup:
                self.deadline = min(self.deadline, self.first_at + STARTUP_STOP_S)
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.kill(None if self.during_startup else
                      f"ranks still alive {self.grace_s:.0f} s after the stop signal")
            self.deadline = None

    def kill(self, why: str | None) -> None:
        if why is not None:
            print(f"pivotrl run: killing the job ({why})", file=sys.stderr)
        for pid in rank_pids(self.run):
            _signal(pid, signal.SIGKILL)
        if self.proc is not None:
            _signal(self.proc.pid, signal.SIGKILL)


STARTUP_STOP_S = 3.0   # a stop before the first trained step: the ranks' time to go


def starting(trace: Path) -> bool:
    """Whether the job is still starting (engines building, nothing to keep): no trace
    segment yet, or the newest one a trace without a trained step. A file that is no
    readable trace (a test's controller writes text) counts as started: the orderly stop."""
    from pivotrl_hpc.checkpoint.layout import segments

    found = segments(trace)
    if not found:
        return True
    try:
        from pivotrl_hpc.trace import open_trace
        with open_trace(str(found[-1])) as t:
            return t.rows("steps") == 0
    except (OSError, KeyError, ValueError):
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def sweep_killed_job(run: PreparedRun) -> None:
    """The run folder's previous job, if every one of its ranks was killed (SIGKILL leaves
    no one to clean), left its GPS segments: remove them before this job starts. A previous
    job still running in this folder is refused."""
    shared = group_shared(run.config)
    old = previous_job(run.paths.logs, shared)
    if old and old != run.job:
        alive = _live_ranks(sorted(run.paths.logs.glob("rank-*.pid")))
        if alive:
            raise LaunchError(f"run folder {run.paths.logs.parent} is in use: job {old} still "
                              f"runs there (rank pids {alive}); stop it or pick another "
                              "trace.path")
        removed = sweep_segments(old) + mpi_private.sweep(old, run.paths.logs)
        cgroup.remove_job(old, wait_s=1.0)
        if removed:
            log.warning("removed %d GPS segment(s) the killed job %s left", len(removed), old)


def rank_pids(run: PreparedRun) -> list[int]:
    """Pids of the job's live ranks (pid files checked against /proc, as pids get reused)."""
    return _live_ranks([run.paths.rank_pid(r) for r in range(run.layout.world_size)])


def _live_ranks(pid_files: list[Path]) -> list[int]:
    pids = []
    for f in pid_files:
        try:
            if f.lstat().st_uid != os.getuid():   # planted in a group-shared folder: not ours
                continue
            pid = int(f.read_text().split()[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (FileNotFoundError, ValueError, IndexError):
            continue
        if b"pivotrl_hpc.launch.entry" in cmdline:
            pids.append(pid)
    return pids


def cleanup(run: PreparedRun) -> None:
    """Whatever the ranks left (killed ones): segments in /dev/shm, cgroups."""
    mpi_private.remove_all(run.env)
    removed = sweep_segments(run.job)
    if removed:
        log.warning("removed %d GPS segment(s) the ranks left: %s", len(removed), removed)
    cgroup.remove_job(run.job, wait_s=10.0)


def sweep_segments(job: str) -> list[str]:
    """`gps.segment.sweep(job)` without importing torch (seconds on a busy machine): every
    file of the job in this user's shm folder (`pivotrl-<job>-<node>-...`: segments, TP
    rendezvous) and the vLLM TP segments in /dev/shm a killed engine host left."""
    from pivotrl_hpc.runtime.tp_world import sweep_job

    removed = []
    for p in shmdir.job_files(job):
        p.unlink(missing_ok=True)
        removed.append(p.name)
    shmdir.remove_if_unused()   # a killed agent never released the folder
    # and the vLLM segments of its TP worlds, and Open MPI's folder on this node
    return removed + sweep_job(job) + mpi_private.sweep(job)


# ---- diagnosis ---------------------------------------------------------------------------
def diagnose(run: PreparedRun, mpirun_stderr: str, rc: int) -> str:
    """One line naming the rank that failed first, its host, role and error."""
    return diagnose_ranks(run.layout, run.paths, mpirun_stderr, rc, "mpirun")


# ---- --np-check -------------------------------------------------------------------------------
_PROBE = ("import os, json, socket; from mpi4py import MPI; c = MPI.COMM_WORLD; "
          "print(json.dumps([c.Get_rank(), c.Get_size(), socket.gethostname()]), flush=True)")


def np_check(run: PreparedRun, timeout: float = 120.0) -> tuple[bool, str]:
    """Start the world once with a probe (no job) and check every rank answers."""
    cmd = run.command[:run.command.index(sys.executable)] + [sys.executable, "-c", _PROBE]
    try:
        folder = mpi_private.check(run.env, create=True)   # the probe's segments: in there
    except mpi_private.MPIFolderError as e:
        return False, str(e)
    try:
        p = subprocess.run(cmd, env={**os.environ, **run.env}, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"the {run.layout.world_size}-rank probe did not finish in {timeout:.0f} s"
    finally:
        mpi_private.remove(folder)
    seen = [json.loads(m) for m in re.findall(r'\[\d+, \d+, "[^"]*"\]', p.stdout)]
    ranks = sorted(r for r, _, _ in seen)
    if p.returncode != 0 or ranks != list(range(run.layout.world_size)):
        return False, (f"mpirun -n {run.layout.world_size} answered ranks {ranks} (exit "
                       f"{p.returncode}): {p.stderr.strip()[-300:]}")
    hosts = sorted({h for _, _, h in seen})
    return True, f"{len(ranks)} ranks answered on {', '.join(hosts)}"
