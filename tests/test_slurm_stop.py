"""The RL job under Slurm stops cleanly and says so: `scancel` mid-run and a job that reaches
its `--time` limit (trace readable, no segment in /dev/shm, no rank left, no error logged,
`sacct` state), and the cancelled run continued by `pivotrl resume`; `pivotrl submit` and
`pivotrl_hpc.submit` (submitit): the summary of a two-node job from `--wait`, refusals
before anything is queued, a broken config's error, a failing rank named."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from live_util import assert_trace_ok, model_overrides
from slurm_util import ROOT, job_segments, sacct_states, submit_pivot, wait_job

pytestmark = pytest.mark.slurm
LEARN = str(ROOT / "configs" / "learn-cpu.yaml")
TWO_NODES = ["cluster.nodes=2", "cluster.devices_per_node=2"]   # learn-cpu's 4 devices
CANCELLED = ["rl.steps=5", "rl.checkpoint_every=2"]


def _sequence_events(trace: Path) -> int:
    """Rows of the trace's `sequences` table so far (-1: no readable trace yet)."""
    from pivotrl_hpc.trace import open_trace

    try:
        with open_trace(str(trace)) as t:
            return t.rows("sequences")
    except (OSError, FileNotFoundError):
        return -1


def _job_processes(job: str, wait_s: float = 10.0) -> list[str]:
    """Processes of the job still alive `wait_s` after it ended (its ranks, the node's engine
    host forker and the engine hosts it forked all carry SLURM_JOB_ID): a job's processes end
    with it."""
    mark = f"SLURM_JOB_ID={job}".encode()
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                if mark in (d / "environ").read_bytes().split(b"\0"):
                    left.append(f"{d.name} {(d / 'cmdline').read_bytes()[:160]!r}")
            except OSError:   # gone meanwhile, or a kernel thread
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _error_lines(trace: Path) -> list[str]:
    """ERROR lines of the job's rank logs."""
    logs = trace.with_suffix(".logs")
    return [line for f in sorted(logs.glob("rank-*.log")) for line in
            f.read_text(errors="replace").splitlines() if " ERROR " in line]


@pytest.fixture(scope="module")
def stopped(slurm_cluster, tiny_models, tmp_path_factory):
    """Two 1-node jobs at once (they share the machine: fine for stopping, not for speed):
    one (on n2) hits --time=1, the other (on n1, shiftable, checkpoints every 2 steps) is
    cancelled once its first checkpoint is whole, rollout well under way.

    Once the cancelled one has ended, while the other runs into its limit, two more start
    (suite time; their tests wait for them): `pivotrl resume --wait` of the cancelled run (a
    half-written checkpoint put there first, as a cancel mid-write leaves it), and
    `pivotrl submit --wait` of a two-node job (learn-cpu at 2 x 2, 1 step: 2 GPUs of each
    node). Not earlier: the time-limited job must be up within its minute."""
    from pivotrl_hpc.checkpoint.layout import latest, root_for

    out = {}
    # --no-requeue: the time-limit signal (sent at once: the limit is shorter than its lead)
    # asks for a checkpoint only, and the job runs into its limit
    for name, limit, node, extra in (("timeout", "--time=1", "n2", ["rl.steps=200"]),
                                     ("cancel", "--time=10", "n1", CANCELLED)):
        folder = tmp_path_factory.mktemp(name)
        job = submit_pivot(slurm_cluster, folder,
                           ["--gres=gpu:4", limit, "--no-requeue", "-w", node],
                           LEARN, [*model_overrides(tiny_models), *extra])
        out[name] = {"job": job, "folder": folder,
                     "trace": folder / "runs" / f"pivotrl-{job}" / "learn-cpu.h5"}
    c = out["cancel"]
    first = c["trace"].with_suffix(".checkpoints") / "step-000002" / "COMPLETE"
    deadline = time.monotonic() + 600
    while not first.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    c["events_at_cancel"] = _sequence_events(c["trace"])
    slurm_cluster.run("scancel", c["job"])
    c["res"] = wait_job(slurm_cluster, c["job"], c["folder"] / "job.out", timeout=300)
    # what it left, before the resume starts in its run folder
    c["processes"], c["errors"] = _job_processes(c["job"]), _error_lines(c["trace"])
    run = c["trace"].parent
    c["ckpt"] = latest(root_for(c["trace"]))
    (root_for(c["trace"]) / ".step-000009.tmp" / "optim").mkdir(parents=True)
    c["resume"] = _start_pivotrl("resume", str(run.relative_to(c["folder"])), "--wait",
                                 cwd=c["folder"], env=slurm_cluster.env)
    two = out["two_nodes"] = {"folder": tmp_path_factory.mktemp("two-nodes")}
    two["proc"] = _start_pivotrl("submit", LEARN, *model_overrides(tiny_models), *TWO_NODES,
                                 "rl.steps=1", "--wait", "--runs-root",
                                 str(two["folder"] / "runs"), cwd=two["folder"],
                                 env=slurm_cluster.env)
    t = out["timeout"]
    t["res"] = wait_job(slurm_cluster, t["job"], t["folder"] / "job.out", timeout=300)
    t["processes"], t["errors"] = _job_processes(t["job"]), _error_lines(t["trace"])
    yield out
    for proc in (c["resume"], two["proc"]):
        if proc.poll() is None:    # its test did not run: do not leave it waiting
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("how,state", [("cancel", "CANCELLED"), ("timeout", "TIMEOUT")])
def test_a_stopped_job_leaves_a_readable_trace_and_nothing_behind(stopped, slurm_cluster,
                                                                  how, state):
    from pivotrl_hpc.trace import open_trace

    r = stopped[how]
    assert r["res"].state.startswith(state), r["res"]
    assert sacct_states(slurm_cluster, r["job"], state)[r["job"]].startswith(state)
    assert "stopped by SIGTERM" in r["res"].output, r["res"].output[-3000:]
    with open_trace(str(r["trace"])) as t:               # closed in order: readable
        events = list(t.table("events")["message"])
        assert t.meta["paradigm"] == "shiftable"
    assert any("stopped by SIGTERM" in m for m in events), events
    assert job_segments(r["job"]) == [] and r["processes"] == []
    # an orderly stop logs no error (every device "did not answer Shutdown within 5 s")
    assert not r["errors"], r["errors"][:5]


def test_scancel_came_mid_run(stopped):
    assert stopped["cancel"]["events_at_cancel"] >= 1


def test_pivotrl_resume_continues_a_cancelled_run_in_its_folder(stopped):
    """`pivotrl resume runs/pivotrl-ID` (relative to the submit dir, as the user types it):
    the next segment in the same run folder, from the newest checkpoint, every step trained
    once, training shifted down again after the resume; a half-written checkpoint the
    cancel left is removed."""
    from pivotrl_hpc.checkpoint.layout import root_for, segments
    from pivotrl_hpc.trace import open_trace

    c = stopped["cancel"]
    run, root, ckpt = c["trace"].parent, root_for(c["trace"]), c["ckpt"]
    at = json.loads((ckpt / "state.json").read_text())["step"]
    p = c["resume"]
    stdout, stderr = p.communicate(timeout=900)
    assert p.returncode == 0, stdout + stderr[-3000:]
    summary = json.loads(stdout.splitlines()[-1])
    assert summary["steps"] == 5 and Path(summary["run_folder"]) == run
    parts = segments(c["trace"])
    assert [x.name for x in parts] == ["learn-cpu.h5", "learn-cpu.seg1.h5"]
    steps = []
    for part in parts:
        with open_trace(str(part)) as t:
            steps.append([int(s) for s in t.table("steps")["step"]])
            shifts = t.table("shifts")
            resumed = t.meta["resumed_from"]
    assert Path(resumed).name == ckpt.name
    # the resumed segment trains every step from the checkpoint's on, once
    assert steps[1] == list(range(at, 5))
    assert set(steps[0]) | set(steps[1]) == set(range(5)), steps
    assert ("training", "down") in set(zip(shifts["role"], shifts["direction"]))
    assert not list(root.glob(".step-*.tmp"))
    assert sorted(x.name for x in run.parent.iterdir()) == [run.name, "submitit"]  # no new run
    assert_trace_ok(*parts)    # lag <= k, tokens conserved, ... in each segment
    assert _job_processes(str(summary["job_id"])) == []


# ---- submitit -------------------------------------------------------------------------------
@pytest.fixture
def submitit_env(slurm_cluster, monkeypatch):
    for k in ("SLURM_CONF", "OMPI_MCA_btl", "UCX_MODULES"):
        monkeypatch.setenv(k, slurm_cluster.env[k])


def _pivotrl(*args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _start_pivotrl(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pivotrl_hpc.cli.main", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=cwd, env=env)


def test_pivotrl_submit_wait_on_two_nodes_prints_the_summary(stopped, slurm_cluster):
    """Two nodes: submitit waits for the batch step's one result (it waited for one per node,
    and a completed job "failed"); no --time: a day, said at submit, not submitit's 5 min."""
    p, folder = stopped["two_nodes"]["proc"], stopped["two_nodes"]["folder"]
    stdout, stderr = p.communicate(timeout=900)
    assert p.returncode == 0, stdout + stderr[-3000:]
    first, summary = stdout.splitlines()[0], json.loads(stdout.splitlines()[-1])
    job = first.split()[2].rstrip(";")
    assert "time limit 24:00:00 (the default; --time sets it); 120 s before it the job " \
           "checkpoints and requeues itself" in first
    info = slurm_cluster.run("scontrol", "show", "job", "-o", job).stdout
    assert "TimeLimit=1-00:00:00" in info and "NumNodes=2" in info
    assert summary["steps"] == 1 and summary["job_id"] == job and summary["tokens_per_s"] > 0
    assert Path(summary["run_folder"]) == folder / "runs" / f"pivotrl-{job}"
    assert Path(summary["trace"]).is_file()
    assert job_segments(job) == []


def test_submit_of_a_broken_config_raises_with_its_error(submitit_env, tiny_models, tmp_path):
    import pivotrl_hpc
    from pivotrl_hpc.config import ConfigError

    broken = [*model_overrides(tiny_models), "rl.stpes=1"]
    with pytest.raises(ConfigError, match="rl.stpes"):        # checked here first
        pivotrl_hpc.submit(LEARN, broken, runs_root=tmp_path / "runs")
    job = pivotrl_hpc.submit(LEARN, broken, runs_root=tmp_path / "runs", check=False,
                             nodes=1, gpus_per_node=4, time=5)
    with pytest.raises(Exception, match="rl.stpes") as e:     # and in the job
        job.result()
    assert "did you mean" in str(e.value) or "unknown" in str(e.value)


def _pivotrl_here(*args: str, monkeypatch, capsys) -> tuple[int, str]:
    """`pivotrl ARGS` in this process: (exit code, stderr). A refusal is mostly the CLI's
    imports (~5 core-s a process here): loaded once, not once per command."""
    from pivotrl_hpc.cli.main import main

    for k, v in (("VLLM_LOGGING_STREAM", "ext://sys.stderr"), ("VLLM_LOGGING_LEVEL", "WARNING"),
                 ("UCX_MODULES", "^ib,rdmacm")):   # what main() sets if unset: undone after
        monkeypatch.setenv(k, os.environ.get(k, v))
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:   # argparse's own refusals
        code = e.code
    return code, capsys.readouterr().err


def test_pivotrl_submit_refuses_before_queueing(submitit_env, tiny_models, tmp_path,
                                                monkeypatch, capsys):
    """A bad config, a request the config or the partition (2 nodes of 8 GPUs) can never
    satisfy, and sbatch's own refusal: one line each, exit 2, nothing left behind. sbatch's
    refusal runs as the `pivotrl` command (the process's exit status), meanwhile the other
    six in this process (each would be mostly its imports)."""
    base = ["submit", LEARN, *model_overrides(tiny_models)]
    cases = ((["rl.stpes=1"], "unknown key"),
             (["--gpus-per-node", "2"], "the config needs 4 GPUs per node"),
             (["--nodes", "2"], "the config needs 1 node(s) (cluster.nodes) but "
                                "2 were asked for: submit with --nodes 1"),
             (["cluster.nodes=3"], "partition debug has 2 node(s) but the job "
                                   "asks for 3 (cluster.nodes)"),
             (["--gpus-per-node", "9"], "at most 8 GPUs but the job asks for 9"),
             (["--partition", "nosuch"], "partition 'nosuch' does not exist"),
             (["--constraint", "nosuch"], "sbatch refused the job: sbatch: "
                                          "error: Batch job submission failed: "
                                          "Invalid feature specification"))
    *here, (extra, message) = cases
    proc = _start_pivotrl(*base, *extra, "--runs-root", str(tmp_path), cwd=tmp_path,
                          env=dict(os.environ))
    monkeypatch.chdir(tmp_path)
    done = [(extra, *_pivotrl_here(*base, *extra, "--runs-root", str(tmp_path),
                                   monkeypatch=monkeypatch, capsys=capsys))
            for extra, _ in here]
    _, stderr = proc.communicate(timeout=120)
    done.append((extra, proc.returncode, stderr))
    for (extra, code, stderr), (_, message) in zip(done, cases):
        # one error line; a logged warning about another key (the tiny config's unused
        # validation file) may come before it
        lines = [ln for ln in stderr.strip().splitlines() if " WARNING " not in ln]
        assert code == 2 and len(lines) == 1 and lines[0].startswith(
            "pivotrl submit: ") and message in lines[0], (extra, stderr)
    assert not (tmp_path / "submitit").exists()                # nothing was submitted


def test_a_failing_rank_raises_from_result_naming_it(submitit_env, tiny_models, tmp_path,
                                                     monkeypatch):
    """`pivotrl submit --wait` exits 1 naming the failing rank; `job.result()` raises with
    the same line."""
    import submitit
    from slurm_util import PROGRAMS

    # the controller is swapped for one that fails (tests/programs/launch_ctl.py): the
    # fault this test injects; the workers, GPS agent and srun world are the real ones
    monkeypatch.setenv("PIVOTRL_CONTROLLER", "launch_ctl:fails")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(PROGRAMS), os.environ.get("PYTHONPATH")])))
    p = _pivotrl("submit", LEARN, *model_overrides(tiny_models), "--wait", "--time", "5",
                 "--runs-root", str(tmp_path / "runs"), cwd=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr[-3000:]
    job = p.stdout.split()[2].rstrip(";")
    assert "(asked for)" in p.stdout
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith(f"pivotrl submit: job {job} failed: job {job}: rank 0 (GPS agent + "
                           "controller, node n1), host ") and \
        "RuntimeError: test controller failure" in line, p.stderr[-3000:]
    with pytest.raises(Exception) as e:
        submitit.SlurmJob(tmp_path / "runs" / "submitit", job).result()
    text = str(e.value)
    assert "SlurmJobError" in text and "rank 0 (GPS agent + controller, node n1), host " in text
    assert "RuntimeError: test controller failure" in text, text
    assert job_segments(job) == []
