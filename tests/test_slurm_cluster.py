"""The local two-node Slurm cluster: shape, GPU GRES, accounting, submitit (the RL job under
Slurm is in test_slurm_job.py)."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from slurm_util import CLUSTER_SH, PROGRAMS, wait_job

pytestmark = pytest.mark.slurm


def test_cluster_shape(slurm_cluster):
    # one partition: the nodes are in `urgent` too (preemption), and sinfo -N lists a node
    # once per partition
    out = slurm_cluster.run("sinfo", "-h", "-N", "-p", "debug", "-o",
                            "%N %c %G %t").stdout.split("\n")
    rows = sorted(line.split() for line in out if line.strip())
    assert [(r[0], r[1], r[2]) for r in rows] == [("n1", "16", "gpu:8"), ("n2", "16", "gpu:8")]
    # responding and usable (other sessions' jobs may keep a node mix/alloc/completing)
    assert all(r[3] in ("idle", "mix", "alloc", "comp") for r in rows), rows


def test_start_is_idempotent_and_env_is_evalable(slurm_cluster):
    t0 = time.monotonic()
    p = slurm_cluster.run(str(CLUSTER_SH), "start")
    assert "already up" in p.stdout and time.monotonic() - t0 < 5
    env = slurm_cluster.run(str(CLUSTER_SH), "env").stdout
    assert f"export SLURM_CONF={slurm_cluster.run_dir}/slurm.conf" in env
    # eval'd in bash, the lines give a working client environment
    p = subprocess.run(["bash", "-c", f'eval "$({CLUSTER_SH} env)" && sinfo -h -p debug -o %D'],
                       env={k: v for k, v in os.environ.items() if k != "SLURM_CONF"},
                       capture_output=True, text=True, timeout=30)
    assert p.stdout.strip() == "2", p.stderr
    bad = subprocess.run([str(CLUSTER_SH), "restart"], capture_output=True, text=True, timeout=10)
    assert bad.returncode == 2 and "usage:" in bad.stderr


def test_sbatch_gres_gpu4(slurm_cluster, tmp_path):
    out = tmp_path / "gpu4.out"
    env = {k: v for k, v in slurm_cluster.env.items() if k != "OMPI_MCA_btl"}  # the prolog sets it
    job = slurm_cluster.sbatch("--gres=gpu:4", "--time=1", "-o", str(out), "--wrap",
                               "echo CVD=$CUDA_VISIBLE_DEVICES; echo ON_NODE=$SLURM_GPUS_ON_NODE; "
                               "echo BTL=$OMPI_MCA_btl", cwd=tmp_path, env=env)
    res = wait_job(slurm_cluster, job, out)
    assert (res.state, res.exit_code) == ("COMPLETED", 0), res
    lines = dict(line.split("=", 1) for line in res.output.splitlines() if "=" in line)
    devices = lines["CVD"].split(",")
    assert len(devices) == 4 and len(set(devices)) == 4, res.output
    assert lines["ON_NODE"] == "4"
    assert lines["BTL"] == "self,tcp"  # from slurm/local/task-prolog.sh


def test_two_node_job_gets_gpus_on_each_node(slurm_cluster, tmp_path):
    out = tmp_path / "two.out"
    job = slurm_cluster.sbatch("-N2", "--gres=gpu:3", "--time=1", "-o", str(out), "--wrap",
                               "srun -n2 --ntasks-per-node=1 bash -c "
                               "'echo $SLURMD_NODENAME $CUDA_VISIBLE_DEVICES'",
                               cwd=tmp_path)
    res = wait_job(slurm_cluster, job, out)
    assert (res.state, res.exit_code) == ("COMPLETED", 0), res
    per_node = dict(line.split() for line in res.output.splitlines() if line.strip())
    assert sorted(per_node) == ["n1", "n2"]
    assert [len(v.split(",")) for v in per_node.values()] == [3, 3]


def test_gres_beyond_node_is_rejected(slurm_cluster, tmp_path):
    p = slurm_cluster.run("sbatch", "--gres=gpu:9", "--wrap", "true", check=False, cwd=tmp_path)
    assert p.returncode != 0 and "Requested node configuration is not available" in p.stderr


def test_sacct_records_states_and_exit_codes(slurm_cluster, tmp_path):
    ok = slurm_cluster.sbatch("--time=1", "-o", "/dev/null", "--wrap", "true", cwd=tmp_path)
    bad = slurm_cluster.sbatch("--time=1", "-o", "/dev/null", "--wrap", "exit 3", cwd=tmp_path)
    for job in (ok, bad):
        wait_job(slurm_cluster, job)
    want = {ok: "COMPLETED|0:0", bad: "FAILED|3:0"}
    rows: dict[str, str] = {}
    for _ in range(50):  # slurmctld reports job ends to slurmdbd asynchronously
        out = slurm_cluster.run("sacct", "-n", "-X", "-P", "-o", "JobID,State,ExitCode",
                                "-j", f"{ok},{bad}").stdout
        rows = {r.split("|", 1)[0]: r.split("|", 1)[1] for r in out.split()}
        if rows == want:
            break
        time.sleep(0.1)
    assert rows == want


def _submitit_executor(folder, monkeypatch, slurm_cluster):
    import submitit

    # submitit runs sbatch/sacct from this process: give it the cluster's environment, and the
    # job a PYTHONPATH from which it can import the submitted function's module
    for k in ("SLURM_CONF", "OMPI_MCA_btl", "UCX_MODULES"):
        monkeypatch.setenv(k, slurm_cluster.env[k])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(PROGRAMS), os.environ.get("PYTHONPATH")])))
    monkeypatch.syspath_prepend(str(PROGRAMS))
    # fresh folder: ids restart per cluster start
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    ex.update_parameters(timeout_min=2)
    return ex


def test_submitit_returns_function_result(slurm_cluster, tmp_path, monkeypatch):
    ex = _submitit_executor(tmp_path / "submitit", monkeypatch, slurm_cluster)
    import funcs

    job = ex.submit(funcs.add_and_report, 2, 3)
    result = job.result()
    assert result == {"sum": 5, "job_id": job.job_id, "node": result["node"]}
    assert result["node"] in ("n1", "n2")

    err = ex.submit(funcs.fail, "boom-42")
    with pytest.raises(Exception, match="boom-42"):
        err.result()


def test_submitit_two_nodes_two_tasks(slurm_cluster, tmp_path, monkeypatch):
    ex = _submitit_executor(tmp_path / "submitit", monkeypatch, slurm_cluster)
    import funcs

    ex.update_parameters(nodes=2, tasks_per_node=2)
    results = ex.submit(funcs.rank_report, 10).results()
    assert [r["global_rank"] for r in results] == [0, 1, 2, 3]
    assert [r["value"] for r in results] == [10, 20, 30, 40]
    assert [(r["node"], r["local_rank"]) for r in results] == [("n1", 0), ("n1", 1),
                                                                ("n2", 0), ("n2", 1)]
    assert {r["num_tasks"] for r in results} == {4}
