"""`pivotrl run`: rank layout, checks before any process, mpirun start-up and stop, signals,
a killed worker, CPU caps. The job tests use a test controller (tests/programs/launch_ctl.py,
PIVOTRL_CONTROLLER). Suite time (issue 51): a job is almost all start-up (2 nodes x 2 devices
~42 CPU-s, 2 x 1 ~31: `pivotrl run`'s preflight 5, each worker's torch + Megatron-Core 4.5, each
node's forker's vLLM import 7), so only the query job runs 2 x 2 (every device's state and cap);
the signal and failure jobs run 2 nodes x 1 device (a second node, its agent and a worker on it:
world 4), and the two-runs-at-once test's runs are the query job and a 1-node job beside it."""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from pivotrl_hpc.config import ConfigError, load_config
from pivotrl_hpc.config.validate import check_cpu_shares
from pivotrl_hpc.gps.shmdir import job_files
from pivotrl_hpc.runtime import cgroup
from pivotrl_hpc.launch.layout import (AGENT, WORKER, LaunchError, RankLayout, check_placement,
                                       expand_hostlist, node_names)

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ROOT / "tests" / "programs"
PYTHON = ROOT / ".venv" / "bin" / "python"


# ---- layout -----------------------------------------------------------------------------------
def test_layout_two_nodes_by_four_devices():
    lay = RankLayout(2, 4, ("n0", "n1"))
    assert lay.world_size == 10 and lay.ranks_per_node == 5
    table = [(i.rank, i.node_name, i.local_rank, i.kind, i.device, i.controller)
             for i in lay.table()]
    assert table == [
        (0, "n0", 0, AGENT, None, True), (1, "n0", 1, WORKER, 0, False),
        (2, "n0", 2, WORKER, 1, False), (3, "n0", 3, WORKER, 2, False),
        (4, "n0", 4, WORKER, 3, False),
        (5, "n1", 0, AGENT, None, False), (6, "n1", 1, WORKER, 4, False),
        (7, "n1", 2, WORKER, 5, False), (8, "n1", 3, WORKER, 6, False),
        (9, "n1", 4, WORKER, 7, False)]
    assert lay.agent_ranks == (0, 5)
    assert lay.worker_ranks == (1, 2, 3, 4, 6, 7, 8, 9)
    assert [lay.worker_rank(d) for d in lay.devices] == [1, 2, 3, 4, 6, 7, 8, 9]
    assert all(lay.device(lay.worker_rank(d)) == d for d in lay.devices)
    assert lay.node_devices(1) == (4, 5, 6, 7)
    with pytest.raises(ValueError):
        lay.info(10)


def test_layout_names_from_slurm_and_placement():
    assert expand_hostlist("n[1-2]") == ["n1", "n2"]
    assert expand_hostlist("gpu[08-10,12],login1") == ["gpu08", "gpu09", "gpu10", "gpu12",
                                                       "login1"]
    assert node_names(2, {}) == ("n0", "n1")
    assert node_names(2, {"SLURM_JOB_NODELIST": "n[1-2]"}) == ("n1", "n2")
    assert node_names(2, {"PIVOTRL_NODE_NAMES": "a,b", "SLURM_JOB_NODELIST": "n1"}) == ("a", "b")
    with pytest.raises(LaunchError, match="cluster.nodes=2"):
        node_names(2, {"SLURM_JOB_NODELIST": "n1"})
    lay = RankLayout(2, 2, ("n1", "n2"))
    check_placement(lay, 4, {"SLURM_NODEID": "1"})
    with pytest.raises(LaunchError, match="--ntasks-per-node=3"):
        check_placement(lay, 2, {"SLURM_NODEID": "1"})


# ---- CPU shares and cgroups -------------------------------------------------------------------
def _cfg(tiny_models: Path, tmp_path: Path, **cluster) -> Path:
    """A job of `cluster` (2 nodes x 2 devices unless overridden), training on every device
    (TP 2): every worker preloads Megatron-Core, as a training device does."""
    m = tiny_models
    cluster = {"nodes": 2, "devices_per_node": 2, "device_kind": "cpu", "cpu_share": 0.2,
               **cluster}
    data = {
        "cluster": cluster,
        "models": {"policy": {"path": str(m / "policy"), "max_prompt_len": 32,
                              "max_response_len": 32},
                   "genrm": {"path": str(m / "genrm"), "max_prompt_len": 80,
                             "max_response_len": 16}},
        "roles": {"train_devices": cluster["nodes"] * cluster["devices_per_node"],
                  "train_tensor_parallel": 2},
        "data": {"train": str(m / "data" / "train.parquet"),
                 "validation": str(m / "data" / "aime-style.parquet")},
        "trace": {"path": str(tmp_path / "out" / "job.h5")},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_cpu_share_refusal_and_override_warning(tiny_models, tmp_path, caplog):
    path = _cfg(tiny_models, tmp_path)
    cfg = load_config(path, ["cluster.devices_per_node=4", "cluster.cpu_share=0.25"])
    with pytest.raises(ConfigError) as e:
        check_cpu_shares(cfg, cores=2)
    msg = str(e.value)
    assert "cluster.cpu_share" in msg and "= 2 cores" in msg and "(1.6)" in msg
    assert "<= 0.2" in msg and "allow_oversubscribe" in msg
    assert check_cpu_shares(load_config(path, ["cluster.devices_per_node=4"]), cores=2) is None
    cfg.cluster.allow_oversubscribe = True
    with caplog.at_level(logging.WARNING):
        warning = check_cpu_shares(cfg, cores=2)
    assert "cluster.cpu_share" in warning and warning in caplog.text
    cfg.cluster.device_kind = "gpu"
    cfg.cluster.allow_oversubscribe = False
    assert check_cpu_shares(cfg, cores=2) is None     # GPUs: nothing to cap


def test_cgroup_files_v1_and_v2(tmp_path):
    mounts = ("cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"
              "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,cpu,cpuacct 0 0\n")
    assert cgroup.find_root(mounts) == cgroup.CpuRoot(1, Path("/sys/fs/cgroup/cpu,cpuacct"))
    assert cgroup.find_root("cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n").version == 2
    for version in (1, 2):
        base = tmp_path / f"v{version}"
        base.mkdir()
        (base / "cgroup.subtree_control").write_text("")
        root = cgroup.CpuRoot(version, base)
        if version == 2:   # the job's own group gets its control file from the kernel
            (base / "pivotrl-j").mkdir()
            (base / "pivotrl-j" / "cgroup.subtree_control").write_text("")
        cap = cgroup.cap_process(1234, "j", "n0-d1", 0.2, root)
        assert cap.group == base / "pivotrl-j" / "n0-d1" and cap.cores == 0.2
        assert (cap.group / "cgroup.procs").read_text() == "1234"
        if version == 1:
            assert (cap.group / "cpu.cfs_quota_us").read_text() == "2000"
            assert (cap.group / "cpu.cfs_period_us").read_text() == "10000"
        else:
            assert (cap.group / "cpu.max").read_text() == "2000 10000"
            assert (base / "cgroup.subtree_control").read_text() == "+cpu"
            assert (base / "pivotrl-j" / "cgroup.subtree_control").read_text() == "+cpu"


def test_cgroup_period_keeps_small_shares_exact():
    """10 ms periods; a share whose quota would fall under the kernel's 1 ms minimum gets a
    longer period, never a larger share."""
    assert cgroup.quota_and_period(0.2) == (2000, 10000)
    assert cgroup.quota_and_period(1.5) == (15000, 10000)
    assert cgroup.quota_and_period(0.05) == (1000, 20000)
    assert cgroup.quota_and_period(0.0004) == (1000, 1_000_000)   # the kernel's bounds
    for cores in (0.01, 0.03, 0.07, 0.2, 0.33):
        quota, period = cgroup.quota_and_period(cores)
        assert quota / period == pytest.approx(cores, rel=0.01)


def _remove_at_once(job: str, start: threading.Barrier, errors: list) -> None:
    start.wait()
    try:
        cgroup.remove_job(job)
    except OSError as e:
        errors.append(e)


def test_agents_sharing_a_host_remove_the_jobs_cgroup_at_once():
    """CI failure: two nodes' GPS agents on one host both ran `remove_job` at the end; one
    listed the job's group after the other had removed it, FileNotFoundError failed a
    completed job. Real cgroups: four removers start together, none may raise."""
    for round_ in range(30):
        job = f"rmrace{os.getpid()}-{round_}"
        cgroup.check_writable(job)
        d = cgroup._prepare_job(cgroup.find_root(), job)
        for name in ("n0-d0", "n1-d1"):
            (d / name).mkdir()
        start, errors = threading.Barrier(4), []
        threads = [threading.Thread(target=_remove_at_once, args=(job, start, errors))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert not d.exists()


# ---- the CLI: checks before any process -------------------------------------------------------
def _env(tmp_path: Path, controller: str = "query_all", **extra) -> dict[str, str]:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    marker = tmp_path / "mpirun-started"
    fake = fake_bin / "fake-mpirun"
    fake.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    fake.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(PROGRAMS), "UCX_MODULES": "^ib,rdmacm",
           "PIVOTRL_CONTROLLER": f"launch_ctl:{controller}", **extra}
    return env


def _pivotrl(*args: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(PYTHON), "-m", "pivotrl_hpc.cli.main", "run", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _with_fake_mpirun(env: dict, tmp_path: Path) -> dict:
    """mpirun on PATH is a script that leaves a marker: a check that fails must not reach it."""
    (tmp_path / "bin" / "mpirun").unlink(missing_ok=True)
    (tmp_path / "bin" / "mpirun").symlink_to(tmp_path / "bin" / "fake-mpirun")
    return {**env, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}"}


BAD_INPUTS = [
    (["rl.stepz=3"], "rl.stepz", "did you mean 'steps'"),
    (["paradigm.name=pivot"], "paradigm.name", "'pivot' is not one of"),
    (["rl.steps"], "rl.steps", "section.key=value"),
    (["models.policy.path=/nonexistent/policy"], "models.policy.path",
     "provide the HuggingFace folder there"),
    (["data.train=/nonexistent/train.jsonl"], "data.train", "does not exist"),
    (["models.genrm.max_response_len=4000"], "models.genrm.max_response_len",
     "exceeds the model's context"),
    (["cluster.cpu_share=0.5"], "cluster.cpu_share", "more than 80 %"),
]


@pytest.mark.parametrize("overrides,key,text", BAD_INPUTS, ids=[b[1] for b in BAD_INPUTS])
def test_bad_input_one_line_exit_2_nothing_started(tiny_models, tmp_path, overrides, key, text):
    env = _with_fake_mpirun(_env(tmp_path), tmp_path)
    p = _pivotrl(str(_cfg(tiny_models, tmp_path)), *overrides, env=env)
    assert p.returncode == 2, p.stdout + p.stderr
    # one error line; a logged warning about another key (e.g. an unused validation file)
    # may come before it
    lines = [ln for ln in p.stderr.strip().splitlines() if " WARNING " not in ln]
    assert len(lines) == 1 and key in lines[0] and text in lines[0], p.stderr
    assert not (tmp_path / "mpirun-started").exists()
    assert not (tmp_path / "out").exists()           # no run folder, no resolved config


def test_cgroup_not_writable_names_path_and_opt_out(tiny_models, tmp_path):
    env = _with_fake_mpirun(_env(tmp_path, PIVOTRL_CGROUP_ROOT="/proc/no-cgroup"), tmp_path)
    cfg = str(_cfg(tiny_models, tmp_path))
    p = _pivotrl(cfg, env=env)
    assert p.returncode == 2
    assert "/proc/no-cgroup/pivotrl-" in p.stderr and "--no-cpu-cap" in p.stderr, p.stderr
    assert not (tmp_path / "mpirun-started").exists() and not (tmp_path / "out").exists()
    p = _pivotrl(cfg, "--no-cpu-cap", "--dry-run", env=env)
    assert p.returncode == 0 and "PIVOTRL_CPU_CAP=off" in p.stdout, p.stderr


def test_dry_run_prints_command_and_layout(tiny_models, tmp_path):
    env = _with_fake_mpirun(_env(tmp_path), tmp_path)
    p = _pivotrl(str(_cfg(tiny_models, tmp_path)), "cluster.nodes=2", "--dry-run", env=env)
    assert p.returncode == 0, p.stderr
    assert re.search(r"mpirun --oversubscribe --allow-run-as-root .*-n 6 .*"
                     r"-m pivotrl_hpc\.launch\.entry \S+/out/job\.config\.json", p.stdout)
    assert "UCX_MODULES=" in p.stdout and "OMP_NUM_THREADS=1" in p.stdout
    # one machine: MPI's out-of-band on loopback, no TCP transport listening (issue 46)
    assert "--mca oob_tcp_if_include lo --mca btl self,vader" in p.stdout
    assert "GLOO_SOCKET_IFNAME=lo" in p.stdout
    assert "rank 3 (GPS agent, node n1)" in p.stdout and "rank 5 (worker of device 3" in p.stdout
    assert not (tmp_path / "mpirun-started").exists() and not (tmp_path / "out").exists()


# ---- real jobs (mpirun) -----------------------------------------------------------------------
class Job:
    """`pivotrl run` in the background; stdout collected line by line."""

    def __init__(self, cfg: Path, env: dict, *args: str):
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([str(PYTHON), "-m", "pivotrl_hpc.cli.main", "run",
                                      str(cfg), *args], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=ROOT)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, i=into: i.extend(s), daemon=True).start()

    def wait_for(self, text: str, timeout: float = 240) -> float:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.out):
            assert self.proc.poll() is None, "".join(self.out + self.err)
            assert time.monotonic() < deadline, f"no {text!r} after {timeout} s"
            time.sleep(0.1)
        return time.monotonic() - self.t0

    def finish(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            time.sleep(0.2)   # the reader threads drain

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    @property
    def job(self) -> str:
        return re.search(r"run (run[0-9a-f]{8}):", self.stderr).group(1)


def _leftovers(job: str) -> list[str]:
    shm = [p.name for p in job_files(job)]
    groups = [str(p) for p in Path("/sys/fs/cgroup/cpu").glob(f"pivotrl-{job}*")]
    return shm + groups


SMALL = {"devices_per_node": 1}   # 2 nodes x 1 device: ranks 0 agent+controller n0, 1 worker
#                                   d0 n0, 2 agent n1, 3 worker d1 n1


@pytest.fixture(scope="module")
def two_runs(tiny_models, tmp_path_factory) -> dict[str, tuple[Job, Path, float]]:
    """Two `pivotrl run`s started together on this machine, both to their end: "a", the
    2 x 2 query job; "b", a 1-node x 2-device one. name -> (job, its folder, seconds)."""
    started = {}
    for name, cluster in (("a", {}), ("b", {"nodes": 1})):
        tmp = tmp_path_factory.mktemp(f"run-{name}")
        started[name] = (Job(_cfg(tiny_models, tmp, **cluster), _env(tmp, "query_all")), tmp)
    runs = {}
    for name, (job, tmp) in started.items():
        job.finish()
        runs[name] = (job, tmp, time.monotonic() - job.t0)
    return runs


def test_start_query_shutdown_caps_applied(two_runs):
    job, tmp_path, seconds = two_runs["a"]
    assert job.proc.returncode == 0, job.stderr
    summary_json = tmp_path / "out" / "job.summary.json"
    assert job.out[-1] == f"summary: {summary_json}\n"
    summary = json.loads(summary_json.read_text())
    assert summary["world"] == 6
    assert summary["states"] == {str(d): [True, "idle"] for d in range(4)}
    assert summary["shutdown"] == {str(d): True for d in range(4)}
    assert summary["caps"] == {str(d): 0.2 for d in range(4)}      # each worker's own quota
    assert _leftovers(job.job) == []
    logs = tmp_path / "out" / "job.logs"
    assert sorted(p.name for p in logs.glob("rank-*.log")) == [f"rank-{r}.log" for r in range(6)]
    assert "worker of device 3 serving" in (logs / "rank-5.log").read_text()
    print(f"start + query + stop of a 2 x 2 job (beside a 1 x 2 one): {seconds:.1f} s")


def test_two_runs_at_once_on_one_machine_both_complete(two_runs):
    """Issue 11.11: each run has its own id, GPS files, ports and cgroups. The runs are
    the query job above (2 x 2, world 6) and a 1 x 2 job (world 3), started together."""
    jobs = {name: job for name, (job, _, _) in two_runs.items()}
    assert [job.proc.returncode for job in jobs.values()] == [0, 0], \
        [job.stderr[-2000:] for job in jobs.values()]
    assert jobs["a"].job != jobs["b"].job
    for name, world, devices in (("a", 6, 4), ("b", 3, 2)):
        summary = json.loads((two_runs[name][1] / "out" / "job.summary.json").read_text())
        assert summary["world"] == world
        assert summary["shutdown"] == {str(d): True for d in range(devices)}
        assert _leftovers(jobs[name].job) == []


def test_sigterm_mid_run_stops_in_order(tiny_models, tmp_path):
    # the shutdown timeout bounds the end of a job, not the job: ranks wait longer than it
    env = _env(tmp_path, "until_stopped", PIVOTRL_SHUTDOWN_TIMEOUT_S="2")
    job = Job(_cfg(tiny_models, tmp_path, **SMALL), env)
    job.wait_for("controller running")
    time.sleep(4)
    t = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    rc = job.finish(timeout=60)
    assert rc == 128 + signal.SIGTERM, job.stderr
    assert "stopped by SIGTERM" in job.stderr
    assert (tmp_path / "out" / "job.h5").read_text().startswith("closed after")
    assert _leftovers(job.job) == []
    logs = tmp_path / "out" / "job.logs"
    for r in range(4):   # every rank stopped in order, none was killed
        assert "stopped in order after SIGTERM" in (logs / f"rank-{r}.log").read_text(), r
    assert "removed" not in job.stderr   # the launcher found nothing left to sweep
    print(f"SIGTERM to exit: {time.monotonic() - t:.1f} s")


def test_launcher_killed_job_stops_by_itself(tiny_models, tmp_path):
    job = Job(_cfg(tiny_models, tmp_path, **SMALL), _env(tmp_path, "until_stopped"))
    job.wait_for("controller running")
    name = job.job
    job.proc.kill()
    config = str(tmp_path / "out" / "job.config.json").encode()
    deadline = time.monotonic() + 30
    while any(config in p.read_bytes() for p in Path("/proc").glob("[0-9]*/cmdline")
              if p.exists()):
        assert time.monotonic() < deadline, "ranks still running 30 s after the launcher died"
        time.sleep(0.5)
    assert _leftovers(name) == []
    assert (tmp_path / "out" / "job.h5").read_text().startswith("closed after")


@pytest.mark.parametrize("rank,named", [
    (3, "rank 3 (worker of device 1, node n1), host "),
    # n1's GPS agent: its client (n1's worker) loses its agent
    (2, "rank 2 (GPS agent, node n1), host ")])
def test_sigkill_of_a_worker_or_agent_ends_job_naming_rank(tiny_models, tmp_path, rank, named):
    job = Job(_cfg(tiny_models, tmp_path, **SMALL), _env(tmp_path, "until_stopped"))
    job.wait_for("controller running")
    logs = tmp_path / "out" / "job.logs"
    os.kill(int((logs / f"rank-{rank}.pid").read_text().split()[0]), signal.SIGKILL)
    t = time.monotonic()
    rc = job.finish(timeout=30)
    seconds = time.monotonic() - t
    assert rc == 1 and seconds < 30
    line = job.stderr.strip().splitlines()[-1]
    assert line.startswith(f"pivotrl run: {named}"), line
    assert "signal 9" in line and f"rank-{rank}.log" in line
    assert "worker" not in named or "role idle" in line
    assert _leftovers(job.job) == []
    print(f"SIGKILL of rank {rank} to exit: {seconds:.1f} s")


def test_stray_sigterm_to_a_blocked_worker_ends_the_job_after_grace(tiny_models, tmp_path):
    """A worker waiting in MPI recv cannot run a Python signal handler; its watchdog still
    ends it after the grace period, and the job stops naming it, instead of hanging."""
    env = _env(tmp_path, "idle", PIVOTRL_STOP_GRACE_S="2")
    job = Job(_cfg(tiny_models, tmp_path, **SMALL), env)
    job.wait_for("controller running")
    logs = tmp_path / "out" / "job.logs"
    os.kill(int((logs / "rank-3.pid").read_text().split()[0]), signal.SIGTERM)
    t = time.monotonic()
    rc = job.finish(timeout=30)
    assert rc == 1 and time.monotonic() - t < 30
    line = job.stderr.strip().splitlines()[-1]
    assert line.startswith("pivotrl run: rank 3 (worker of device 1, node n1), host "), line
    assert "not done 2 s after SIGTERM" in line
    assert _leftovers(job.job) == []


def test_diagnose_names_rank_from_mpirun_messages(tmp_path):
    from pivotrl_hpc.launch.layout import RunPaths
    from pivotrl_hpc.launch.local import PreparedRun, diagnose

    paths = RunPaths(tmp_path / "t.h5")
    paths.logs.mkdir()
    run = PreparedRun(RankLayout(2, 2, ("n0", "n1")), paths, "j", {}, [], {})
    paths.rank_log(2).write_text("x r2 n0 worker d1 vm INFO pivotrl_hpc.launch: role reward "
                                 "(replica 1)\nx r2 n0 worker d1 vm ERROR m: out of memory\n")
    died = "mpirun noticed that process rank 2 with PID 0 on node vm exited on signal 9 (Killed)."
    assert diagnose(run, died, 137) == (
        "rank 2 (worker of device 1, node n0), host vm, role reward failed: killed by signal 9 "
        f"(Killed) (last log line: out of memory); log {paths.rank_log(2)}")
    abort = "MPI_ABORT was invoked on rank 4 in communicator MPI_COMM_WORLD\nwith errorcode 1."
    assert diagnose(run, abort, 1).startswith("rank 4 (worker of device 2, node n1), host ? "
                                              "failed: called MPI Abort")
    exited = "  Process name: [[9932,1],3]\n  Exit code:    2\n"
    assert "rank 3 (GPS agent, node n1)" in diagnose(run, exited, 2)
    assert "exited with code 2" in diagnose(run, exited, 2)
    paths.rank_error(0).write_text(json.dumps({"rank": 0, "host": "h0",
                                               "error": "RuntimeError: boom"}))
    assert diagnose(run, died, 1).startswith("rank 0 (GPS agent + controller, node n0), host "
                                             "h0 failed: RuntimeError: boom")


def test_a_refused_rank_ends_the_job_with_exit_2(tmp_path):
    """A squatted forker name, GPS socket name or GPS folder is a refusal the user fixes
    (exit 2, like bad input); any other failure of a rank is exit 1. The code travels from
    the rank's error file to `pivotrl run` / the Slurm job's exit."""
    from types import SimpleNamespace

    from pivotrl_hpc.config.schema import Config
    from pivotrl_hpc.gps.conns import NameTaken
    from pivotrl_hpc.gps.shmdir import FolderRefused
    from pivotrl_hpc.launch.diagnose import job_exit_code
    from pivotrl_hpc.launch.entry import Rank, failure_code
    from pivotrl_hpc.launch.layout import RunPaths
    from pivotrl_hpc.runtime.host_forker import ForkerRefused

    refusals = (ForkerRefused("held by nobody"), NameTaken("bound"), FolderRefused("nobody's"))
    assert [failure_code(e) for e in refusals] == [2, 2, 2]
    assert failure_code(RuntimeError("boom")) == failure_code(PermissionError("x")) == 1
    paths = RunPaths(tmp_path / "t.h5")
    paths.logs.mkdir()
    assert job_exit_code(paths) == 1   # no rank wrote an error: a crash, a signal
    info = RankLayout(1, 2, ("n0",)).info(2)
    rank = SimpleNamespace(info=info, paths=paths, error_written=False, cfg=Config())
    rank._write_log_file = functools.partial(Rank._write_log_file, rank)
    Rank._write_error(rank, RuntimeError("boom"))
    assert job_exit_code(paths) == 1
    Rank._write_error(rank, refusals[0])   # a rank's first error is the one it names
    assert json.loads(paths.rank_error(2).read_text())["exit_code"] == 1
    paths.rank_error(2).unlink()
    rank.error_written = False
    Rank._write_error(rank, refusals[0])
    assert json.loads(paths.rank_error(2).read_text())["exit_code"] == 2
    assert job_exit_code(paths) == 2


def test_controller_failure_names_rank_0(tiny_models, tmp_path):
    job = Job(_cfg(tiny_models, tmp_path, **SMALL), _env(tmp_path, "fails"))
    rc = job.finish()
    assert rc == 1
    line = job.stderr.strip().splitlines()[-1]
    assert line.startswith("pivotrl run: rank 0 (GPS agent + controller, node n0), host ")
    assert "RuntimeError: test controller failure" in line
    assert _leftovers(job.job) == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def test_an_earlier_starts_logs_are_kept_beside_the_next_one(tmp_path):
    """A requeued job starts again in its run folder: the logs of the start before (what made
    it stop) move to logs/start-K/, the newest KEEP_STARTS kept; the run-folder state stays."""
    from pivotrl_hpc.launch.layout import KEEP_STARTS, RunPaths

    paths = RunPaths(tmp_path / "t.h5")
    paths.logs.mkdir()
    assert paths.keep_previous_logs() is None
    (paths.logs / "job").write_text("7\n")
    for start in range(1, KEEP_STARTS + 3):
        paths.rank_log(0).write_text(f"start {start}\n")
        paths.rank_pid(0).write_text("1 h\n")
        (paths.logs / "srun.log").write_text(f"srun {start}\n")
        assert paths.keep_previous_logs() == paths.logs / f"start-{start}"
        assert sorted(p.name for p in paths.logs.iterdir() if p.is_file()) == ["job"]
    kept = sorted(paths.logs.glob("start-*"))
    assert [p.name for p in kept] == [f"start-{k}" for k in range(3, KEEP_STARTS + 3)]
    assert (kept[-1] / "rank-0.log").read_text() == f"start {KEEP_STARTS + 2}\n"
    assert sorted(p.name for p in kept[0].iterdir()) == ["rank-0.log", "rank-0.pid", "srun.log"]


@pytest.mark.parametrize("mode, printed", [("check", "check stopped by SIGTERM"),
                                           ("no-check", "end"), ("deferred", "end")])
def test_a_stop_signal_lost_in_a_finalizer_is_caught_by_the_loops_check(mode, printed):
    """The signal's handler raises inside a __del__, where Python prints the exception and
    drops it: without `Stopper.check` the loop runs to its end; with it, the loop stops
    LOST_S later; a deferred stop (a grace-time checkpoint) is left to the controller."""
    p = subprocess.run([str(PYTHON), str(PROGRAMS / "lost_stop.py"), mode], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert p.stdout.strip() == printed, (p.stdout, p.stderr)
    assert "Exception ignored in" in p.stderr and "Interrupted" in p.stderr, p.stderr
    if mode == "check":
        assert "(its interrupt was lost): stopping it now" in p.stderr, p.stderr
