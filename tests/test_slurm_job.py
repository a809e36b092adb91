"""The RL job under Slurm on the local two-node cluster: `sbatch slurm/pivot.sbatch` (allocation
refusals before srun, shiftable and a static baseline on 2 nodes, scancel and the time limit)
and `pivotrl_hpc.submit` (submitit). Jobs run the real system: mpi over srun --mpi=pmix, one
GPS agent per node, vLLM, Megatron, capped devices."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from live_util import check_nothing_lost, model_overrides
from slurm_util import ROOT, job_segments, sacct_states, submit_pivot, wait_job

pytestmark = pytest.mark.slurm
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
LEARN = str(ROOT / "configs" / "learn-cpu.yaml")


# ---- refused before srun --------------------------------------------------------------------
REFUSALS = {
    # name: (sbatch options, config, extra overrides, env, message)
    "no_gpus": (["-N2"], TINY, [], {}, "no GPUs allocated on n1; submit with --gres=gpu:4"),
    "uneven_gpus": (["-N2", "--gpus=3"], TINY, [], {},
                    "GPUs are split unevenly across nodes (n1: 2, n2: 1)"),
    "fewer_gpus": (["-N2", "--gres=gpu:2"], TINY, [], {},
                   "the config needs 4 GPUs per node (cluster.devices_per_node) but job"),
    "fewer_nodes": (["-N1", "--gres=gpu:4"], TINY, [], {},
                    "the config needs 2 node(s) (cluster.nodes) but job"),
    "too_few_cpus": (["-N2", "--gres=gpu:4", "--cpus-per-gpu=1"], TINY, [], {},
                     "5 tasks per node (1 GPS agent + 4 device workers) need 5 CPUs but node "
                     "n1 has 4"),
    "missing_config": (["--gres=gpu:4"], "no-such.yaml", [], {},
                       "config file 'no-such.yaml' not found"),
    "python_without_package": (["--gres=gpu:4"], LEARN, [], {"PIVOTRL_PYTHON": "/usr/bin/python3"},
                               "'/usr/bin/python3' cannot import: pivotrl_hpc mpi4py"),
    # submitted from a checkout without the venv: pivotrl_hpc imports from the submit dir,
    # mpi4py, vLLM and Megatron do not (every rank died at import, in srun.log only)
    "checkout_without_venv": (["--gres=gpu:4"], LEARN, [], {"PIVOTRL_PYTHON": "/usr/bin/python3"},
                              "cannot import: pivotrl_hpc mpi4py torch vllm megatron.core. "
                              "Activate the venv before sbatch"),
    "bad_config_key": (["--gres=gpu:4"], LEARN, ["rl.stpes=3"], {}, "rl.stpes"),
}


@pytest.fixture(scope="module")
def refused(slurm_cluster, tiny_models, tmp_path_factory):
    """Every refusal case submitted at once (each job ends within seconds)."""
    jobs = {}
    for name, (args, config, extra, env, _) in REFUSALS.items():
        folder = tmp_path_factory.mktemp(name)
        if name == "checkout_without_venv":
            (folder / "pivotrl_hpc").symlink_to(ROOT / "pivotrl_hpc")
        jobs[name] = (submit_pivot(slurm_cluster, folder, [*args, "--time=1"], config,
                              [*model_overrides(tiny_models), *extra], **env), folder)
    return {name: (job, wait_job(slurm_cluster, job, folder / "job.out", timeout=120))
            for name, (job, folder) in jobs.items()}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_pivot_sbatch_refuses_a_wrong_allocation_before_srun(refused, slurm_cluster, case):
    job, res = refused[case]
    assert (res.state, res.exit_code) == ("FAILED", 2), res
    assert "pivot.sbatch: error: " in res.output and REFUSALS[case][4] in res.output, res.output
    # refused before any work: the error is the job's only line (the allocation is checked
    # before the preflight builds the RL task, seconds of CPU that log as they go)
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert not [s for s in sacct_states(slurm_cluster, job) if s.startswith(f"{job}.")
                and s.split(".")[1][:1].isdigit()], "a job step started"


# ---- the job runs ---------------------------------------------------------------------------
def _watch(trace: Path, job: str, slurm_cluster, timeout_s: float) -> list[int]:
    """Steps a reader sees in the trace while the job runs (SWMR)."""
    from pivotrl_hpc.trace import open_trace

    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not slurm_cluster.run("squeue", "-h", "-j", job, check=False).stdout.strip():
            break
        if trace.exists():
            try:
                with open_trace(str(trace)) as t:
                    if t.summary is None:
                        seen.append(t.rows("steps"))
            except OSError:
                pass  # created, not yet in SWMR mode
        time.sleep(2)
    return seen


def _submit(slurm_cluster, tiny_models, folder, sbatch_args, config, overrides) -> dict:
    job = submit_pivot(slurm_cluster, folder, [*sbatch_args, "--time=15"], config,
                       [*model_overrides(tiny_models), *overrides])
    name = Path(config).stem
    run = folder / "runs" / f"pivotrl-{job}"
    return {"job": job, "folder": folder, "trace": run / f"{name}.h5",
            "summary_path": run / f"{name}.summary.json"}


def _finish(slurm_cluster, sub: dict, watch: bool = False) -> dict:
    seen = _watch(sub["trace"], sub["job"], slurm_cluster, 900) if watch else []
    res = wait_job(slurm_cluster, sub["job"], sub["folder"] / "job.out", timeout=900)
    summary = sub["summary_path"]
    return {"job": sub["job"], "res": res, "trace": sub["trace"], "seen": seen,
            "summary": json.loads(summary.read_text()) if summary.exists() else None}


@pytest.fixture(scope="module")
def two_node_jobs(slurm_cluster, tiny_models, tmp_path_factory) -> dict[str, dict]:
    """The shiftable job (a reader watching its trace) and the static baseline, submitted
    together (suite time: each is mostly its start-up; the nodes' 8 GPUs and 16 CPUs hold
    both jobs' 4 GPUs x 2 CPUs per node)."""
    jobs = {"shiftable": _submit(slurm_cluster, tiny_models,
                                 tmp_path_factory.mktemp("shiftable"),
                                 ["-N2", "--gres=gpu:4"], TINY,
                                 ["rl.eval_every=3", "rl.eval_prompts=4"]),
            "static": _submit(slurm_cluster, tiny_models, tmp_path_factory.mktemp("static"),
                              ["-N2", "--gres=gpu:4"], TINY,
                              ["paradigm.name=disaggregated",
                               "paradigm.initial_rollout_devices=2",
                               "paradigm.initial_reward_devices=2"])}
    return {name: _finish(slurm_cluster, sub, watch=name == "shiftable")
            for name, sub in jobs.items()}


@pytest.fixture(scope="module")
def shiftable(two_node_jobs):
    return two_node_jobs["shiftable"]


def test_shiftable_on_two_nodes_completes_three_steps(shiftable):
    res, s = shiftable["res"], shiftable["summary"]
    assert (res.state, res.exit_code) == ("COMPLETED", 0), res.output[-3000:]
    assert f"run folder {shiftable['trace'].parent}" in res.output
    assert s["steps"] == 3 and s["paradigm"] == "shiftable" and s["in_flight_at_end"] == 0
    assert [v["step"] for v in s["validation"]] == [3]
    rss = s["peak_rss_mb"]                           # every worker rank and engine host
    assert sorted(rss) == [str(d) for d in range(8)]
    assert all(v["host:genrm"] > 200 for v in rss.values())   # every device served GenRM
    assert "end-to-end" in res.output and "peak RSS: worker ranks" in res.output


def test_the_live_job_keeps_readable_samples_and_val_accuracy(shiftable):
    """Issue 48 on the live two-node job (no run of its own): the first 4 samples of every
    step and of the evaluation after the last step kept with their texts, val_accuracy in
    the last step's row (the evaluation after step 3), and `pivotrl trace samples`."""
    import math
    import subprocess
    import sys

    from pivotrl_hpc.trace import open_trace

    with open_trace(str(shiftable["trace"])) as t:
        steps, kept, val = t.table("steps"), t.table("samples"), t.table("validation")
    accuracy = shiftable["summary"]["validation"][0]["accuracy"]
    assert math.isnan(steps["val_accuracy"][0]) and math.isnan(steps["val_accuracy"][1])
    assert steps["val_accuracy"][2] == accuracy
    assert [(int(s), d) for s, d in zip(val["step"], val["data_source"])] == [
        (3, ""), (3, "aime24")]
    kinds = list(kept["kind"])
    assert kinds.count("train") == 3 * 4 and kinds.count("eval") == 4
    for i, kind in enumerate(kinds):
        assert "Answer:" in kept["prompt"][i] and kept["response_tokens"][i] > 0
        if kind == "train":
            assert kept["parse"][i] in ("parsed", "unparsed", "truncated")
            assert kept["judge_tokens"][i] > 0 and isinstance(kept["judgement"][i], str)
            assert kept["data_source"][i] == "math_dapo"
    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "trace", "samples",
                        str(shiftable["trace"])], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.count("== step ") == 12, p.stderr
    assert p.stdout.count("judgement (") == 12 and "16 of 16 kept samples" in p.stderr


def test_trace_shows_ranks_on_both_nodes_and_writes_replicated_to_both(shiftable):
    from pivotrl_hpc.trace import open_trace

    with open_trace(str(shiftable["trace"])) as t:
        ranks, gps = t.meta["ranks"], t.table("gps")
    assert [(r["rank"], r["host"], r["kind"]) for r in ranks] == [
        (i, "n1" if i < 5 else "n2", "agent" if i % 5 == 0 else "worker") for i in range(10)]
    writes = [v for op, v in zip(gps["op"], gps["version"]) if op == "write"]
    assert writes == [1, 2, 3]
    published = sorted((v, n) for op, v, n in zip(gps["op"], gps["version"], gps["node"])
                       if op == "publish")
    assert published == [(v, n) for v in (1, 2, 3) for n in (0, 1)]
    assert (gps["bytes"] > 0).all() and (gps["seconds"] >= 0).all()
    assert set(gps["rank"]) == {1}                    # training DP rank 0 on device 0


def test_shiftable_loses_nothing_and_shifts_every_way(shiftable):
    shifts = check_nothing_lost(shiftable["trace"], steps=3, per_step=4 * 4,
                                staleness=2)["shifts"]
    assert {"reward", "rollout", "training"} <= set(shifts["role"])
    ups = [(r, d) for r, d, di in zip(shifts["role"], shifts["devices"], shifts["direction"])
           if di == "up"]
    assert any(r == "reward" for r, _ in ups)
    assert all(len(d.split(",")) == 2 for r, d in ups if r == "reward")       # GenRM TP=2
    assert [d for r, d in ups if r == "training"] == ["0,1,2,3"]                # TP=2 x DP=2
    assert all("total" in p for p in shifts["phases"])


def test_a_reader_sees_steps_while_the_job_runs_and_nothing_is_left(shiftable):
    assert shiftable["seen"] and shiftable["seen"] == sorted(shiftable["seen"])
    assert job_segments(shiftable["job"]) == []


def test_a_static_baseline_on_two_nodes_completes(two_node_jobs):
    r = two_node_jobs["static"]
    assert (r["res"].state, r["res"].exit_code) == ("COMPLETED", 0), r["res"].output[-3000:]
    assert r["summary"]["steps"] == 3 and r["summary"]["paradigm"] == "disaggregated"
    check_nothing_lost(r["trace"], steps=3, per_step=4 * 4, staleness=2)
    assert job_segments(r["job"]) == []
