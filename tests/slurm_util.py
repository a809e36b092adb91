"""Helpers for tests that use the local two-node Slurm cluster (slurm/local/cluster.sh).

`acquire_cluster()` starts the cluster (or finds it up) and `release_cluster()` stops it only if
some pytest session started it and no other session still uses it: each session holds a shared
flock on <run_dir>/pytest.lease, and the last one out takes it exclusively and stops the cluster.
A cluster started outside pytest (e.g. by `make test`) is never stopped here.
"""
from __future__ import annotations

import fcntl
import json
import os
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_SH = ROOT / "slurm" / "local" / "cluster.sh"
PROGRAMS = ROOT / "tests" / "programs"
PYTHON = ROOT / ".venv" / "bin" / "python"


@dataclass
class SlurmCluster:
    run_dir: Path
    env: dict[str, str]  # full environment for subprocess: os.environ + cluster settings
    started_here: bool
    _lease: object = field(default=None, repr=False)

    def run(self, *cmd: str, timeout: float = 30, check: bool = True,
            **kw) -> subprocess.CompletedProcess:
        """Run a Slurm client (or anything) against this cluster; text output captured."""
        p = subprocess.run(list(cmd), env=kw.pop("env", self.env), capture_output=True, text=True,
                           timeout=timeout, **kw)
        if check and p.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd)} -> rc={p.returncode}\n{p.stdout}\n{p.stderr}")
        return p

    def sbatch(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
        """Submit; return the job id. `args` are sbatch options and the script/--wrap."""
        p = self.run("sbatch", "--parsable", *args, cwd=cwd, env=env or self.env)
        return p.stdout.strip().split(";")[0]


@dataclass
class JobResult:
    job_id: str
    state: str       # e.g. COMPLETED, FAILED, TIMEOUT
    exit_code: int   # of the batch script
    output: str      # the job's output file ("" if none)


def _cluster_env(run_dir: Path) -> dict[str, str]:
    """os.environ plus the `export K=V` lines of `cluster.sh env`."""
    p = subprocess.run([str(CLUSTER_SH), "env"], capture_output=True, text=True, check=True,
                       env={**os.environ, "PIVOT_SLURM_RUN_DIR": str(run_dir)})
    env = {**os.environ, "PIVOT_SLURM_RUN_DIR": str(run_dir)}
    for line in p.stdout.splitlines():
        words = shlex.split(line)
        if words[:1] == ["export"]:
            for kv in words[1:]:
                k, v = kv.split("=", 1)
                env[k] = v
    return env


def acquire_cluster(run_dir: Path | None = None, timeout: float = 90) -> SlurmCluster:
    run_dir = Path(os.environ.get("PIVOT_SLURM_RUN_DIR", run_dir or ROOT / ".run" / "slurm"))
    run_dir.mkdir(parents=True, exist_ok=True)
    lease = open(run_dir / "pytest.lease", "a+")
    fcntl.flock(lease, fcntl.LOCK_SH)
    env = {**os.environ, "PIVOT_SLURM_RUN_DIR": str(run_dir)}
    # start is idempotent and serialised by cluster.sh's own lock; "already up" = not ours
    p = subprocess.run([str(CLUSTER_SH), "start"], env=env, capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        lease.close()
        raise RuntimeError(f"slurm/local/cluster.sh start failed (rc={p.returncode}):\n"
                           f"{p.stdout}\n{p.stderr}")
    started = "already up" not in p.stdout
    if started:
        (run_dir / "pytest.started").touch()  # a pytest session owns this cluster
    return SlurmCluster(run_dir=run_dir, env=_cluster_env(run_dir), started_here=started,
                        _lease=lease)


def release_cluster(cluster: SlurmCluster) -> bool:
    """Stop the cluster if a pytest session started it and no other session holds a lease.
    Returns True if it was stopped."""
    lease = cluster._lease
    fcntl.flock(lease, fcntl.LOCK_UN)
    try:
        fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another session still uses it; the last one stops it
        lease.close()
        return False
    try:
        marker = cluster.run_dir / "pytest.started"
        if not marker.exists():
            return False
        env = {**os.environ, "PIVOT_SLURM_RUN_DIR": str(cluster.run_dir)}
        subprocess.run([str(CLUSTER_SH), "stop"], env=env, capture_output=True, timeout=60,
                       check=True)
        marker.unlink(missing_ok=True)
        return True
    finally:
        lease.close()


FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE")


def job_state(cluster: SlurmCluster, job_id: str) -> str | None:
    """scontrol's JobState (None once the job is no longer known)."""
    info = cluster.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
    return dict(t.split("=", 1) for t in info.split() if "=" in t).get("JobState")


def wait_job(cluster: SlurmCluster, job_id: str, output: Path | None = None,
             timeout: float = 30) -> JobResult:
    """Wait until the job has ended for good (at most `timeout` s, then cancel it and fail),
    then return its final state and exit code (scontrol) and its output file's text. A final
    JobState, not an empty squeue: a job being requeued leaves the queue for a moment
    (REQUEUED), which would look like the end."""
    deadline = time.monotonic() + timeout
    while (state := job_state(cluster, job_id)) not in FINAL and state is not None:
        if time.monotonic() > deadline:
            cluster.run("scancel", job_id, check=False)
            raise TimeoutError(f"job {job_id} still {state} after {timeout} s (cancelled)")
        time.sleep(0.2)
    info = cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    kv = dict(t.split("=", 1) for t in info.split() if "=" in t)
    code = int(kv.get("ExitCode", "0:0").split(":")[0])
    text = ""
    if output is not None:
        # the batch step writes the file; it can trail the state change by a moment
        for _ in range(25):
            if output.exists():
                break
            time.sleep(0.1)
        text = output.read_text() if output.exists() else ""
    return JobResult(job_id=job_id, state=kv.get("JobState", "?"), exit_code=code, output=text)


def json_lines(text: str) -> list[dict]:
    """The JSON objects in a program's output (one per line; other lines ignored)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


# ---- the RL job under Slurm (slurm/pivot.sbatch) ------------------------------------------------
PIVOT_SBATCH = str(ROOT / "slurm" / "pivot.sbatch")


def submit_pivot(cluster: SlurmCluster, folder: Path, sbatch_args, config: str,
                 overrides, **env: str) -> str:
    """sbatch slurm/pivot.sbatch from `folder` (the submit dir: runs/ and job.out go there)."""
    folder.mkdir(parents=True, exist_ok=True)
    job_env = {**cluster.env, "PIVOTRL_PYTHON": str(PYTHON), **env}
    return cluster.sbatch(*sbatch_args, "-o", str(folder / "job.out"), PIVOT_SBATCH, config,
                          *overrides, cwd=folder, env=job_env)


def sacct_states(cluster: SlurmCluster, job: str, want: str | None = None) -> dict[str, str]:
    """JobID -> State of the job and its steps (accounting trails the job by a moment: wait
    until the job's state starts with `want`)."""
    rows: dict[str, str] = {}
    for _ in range(50):
        out = cluster.run("sacct", "-n", "-P", "-o", "JobID,State", "-j", job).stdout
        rows = dict(line.split("|", 1) for line in out.splitlines() if "|" in line)
        if want is None or rows.get(job, "").startswith(want):
            break
        time.sleep(0.2)
    return rows


def job_segments(job: str) -> list[str]:
    """The job's GPS segments (named pivotrl-<job id>-<node>-..., in this user's shm folder)."""
    from pivotrl_hpc.gps.shmdir import job_files
    return [p.name for p in job_files(job)]
