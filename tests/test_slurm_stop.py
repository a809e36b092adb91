"""The RL job under Slurm stops cleanly and says so: `scancel` mid-run and a job that reaches
its `--time` limit (trace readable, no segment in /dev/shm, no rank left, `sacct` state), and
`pivotrl_hpc.submit` from Python (the summary from `job.result()`, a broken config's error)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from live_util import model_overrides
from slurm_util import ROOT, job_segments, sacct_states, submit_pivot, wait_job

pytestmark = pytest.mark.slurm
LEARN = str(ROOT / "configs" / "learn-cpu.yaml")


def _sequence_events(trace: Path) -> int:
    """Rows of the trace's `sequences` table so far (-1: no readable trace yet)."""
    from pivotrl_hpc.trace import open_trace

    try:
        with open_trace(str(trace)) as t:
            return t.rows("sequences")
    except (OSError, FileNotFoundError):
        return -1


def _ranks_left(job: str) -> list[str]:
    p = subprocess.run(["pgrep", "-af", "pivotrl_hpc.launch.entry"], capture_output=True,
                       text=True)
    return [line for line in p.stdout.splitlines() if f"pivotrl-{job}/" in line]


@pytest.fixture(scope="module")
def stopped(slurm_cluster, tiny_models, tmp_path_factory):
    """Two 1-node jobs at once (they share the machine: fine for stopping, not for speed):
    one hits --time=1, the other is cancelled once its trace shows rollout under way."""
    overrides = [*model_overrides(tiny_models), "rl.steps=200"]
    out = {}
    # --no-requeue: the time-limit signal (sent at once: the limit is shorter than its lead)
    # asks for a checkpoint only, and the job runs into its limit
    for name, limit in (("timeout", "--time=1"), ("cancel", "--time=10")):
        folder = tmp_path_factory.mktemp(name)
        job = submit_pivot(slurm_cluster, folder, ["--gres=gpu:4", limit, "--no-requeue"],
                           LEARN, overrides)
        out[name] = {"job": job, "folder": folder,
                     "trace": folder / "runs" / f"pivotrl-{job}" / "learn-cpu.h5"}
    c = out["cancel"]
    deadline = time.monotonic() + 300
    while _sequence_events(c["trace"]) < 1 and time.monotonic() < deadline:
        time.sleep(1)
    c["events_at_cancel"] = _sequence_events(c["trace"])
    slurm_cluster.run("scancel", c["job"])
    for r in out.values():
        r["res"] = wait_job(slurm_cluster, r["job"], r["folder"] / "job.out", timeout=300)
    return out


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
    assert job_segments(r["job"]) == [] and _ranks_left(r["job"]) == []


def test_scancel_came_mid_run(stopped):
    assert stopped["cancel"]["events_at_cancel"] >= 1


# ---- submitit -------------------------------------------------------------------------------
@pytest.fixture
def submitit_env(slurm_cluster, monkeypatch):
    for k in ("SLURM_CONF", "OMPI_MCA_btl", "UCX_MODULES"):
        monkeypatch.setenv(k, slurm_cluster.env[k])


def test_submit_from_python_returns_the_summary(submitit_env, tiny_models, tmp_path):
    import pivotrl_hpc

    job = pivotrl_hpc.submit(LEARN, [*model_overrides(tiny_models), "rl.steps=1"],
                             runs_root=tmp_path / "runs", time=10)
    summary = job.result()
    assert summary["steps"] == 1 and summary["job_id"] == job.job_id
    assert Path(summary["run_folder"]) == tmp_path / "runs" / f"pivotrl-{job.job_id}"
    assert Path(summary["trace"]).is_file() and summary["tokens_per_s"] > 0
    assert job_segments(job.job_id) == []


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


def test_pivotrl_submit_refuses_before_queueing(submitit_env, tiny_models, tmp_path):
    import subprocess
    import sys

    base = [sys.executable, "-m", "pivotrl_hpc.cli.main", "submit", LEARN,
            *model_overrides(tiny_models)]
    for extra, message in ((["rl.stpes=1"], "unknown key"),
                           (["--gpus-per-node", "2"], "the config needs 4 GPUs per node"),
                           (["--nodes", "2"], "the config needs 1 node(s) (cluster.nodes)")):
        p = subprocess.run([*base, *extra, "--runs-root", str(tmp_path)], capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 2 and p.stderr.startswith("pivotrl submit: ") \
            and message in p.stderr, (extra, p.stderr)
    assert not (tmp_path / "submitit").exists()                # nothing was submitted


def test_a_failing_rank_raises_from_result_naming_it(submitit_env, tiny_models, tmp_path,
                                                     monkeypatch):
    import pivotrl_hpc
    from slurm_util import PROGRAMS

    # the controller is swapped for one that fails (tests/programs/launch_ctl.py): the
    # fault this test injects; the workers, GPS agent and srun world are the real ones
    monkeypatch.setenv("PIVOTRL_CONTROLLER", "launch_ctl:fails")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(PROGRAMS), os.environ.get("PYTHONPATH")])))
    job = pivotrl_hpc.submit(LEARN, model_overrides(tiny_models), runs_root=tmp_path / "runs",
                             time=5)
    with pytest.raises(Exception) as e:
        job.result()
    text = str(e.value)
    assert "SlurmJobError" in text and "rank 0 (GPS agent + controller, node n1), host " in text
    assert "RuntimeError: test controller failure" in text, text
    assert job_segments(job.job_id) == []
