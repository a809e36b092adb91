"""The Slurm ways in without a cluster: what `pivotrl submit` / `pivotrl resume` decide before
anything is queued (the partition's limits and the time limit, a relative `resume=`, the run
folder a resumed job continues in, the note about an earlier run's checkpoints), submitit's
one task per job, how a failed job's error and a rank that died before its log are reported.
(File modes of checkpoints and exports: tests/test_checkpoint.py; jobs on the local cluster:
tests/test_slurm_*.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pivotrl_hpc.checkpoint import layout, writer
from pivotrl_hpc.checkpoint.layout import CheckpointError
from pivotrl_hpc.launch.layout import LaunchError, RankLayout, RunPaths


def _checkpoint(root: Path, step: int) -> Path:
    tmp = writer.staging(root, step)
    (tmp / layout.POLICY).mkdir()
    writer.write_state(tmp, {"step": step, "version": step, "fixed": {}})
    return writer.commit(tmp, keep=10)


def test_partition_limits_refuse_what_would_pend_forever():
    from pivotrl_hpc.launch.partition import (Partition, check_request, default_time,
                                              parse_minutes)

    part = Partition("debug", nodes=2, gpus=8, cpus=16, max_time_min=600)
    check_request(part, 2, 4, 8, 600)                   # fits: nothing said
    for args, message in (((3, 4, 8, 60), "partition debug has 2 node(s) but the job asks "
                                          "for 3 (cluster.nodes): it would pend forever"),
                          ((2, 9, 8, 60), "at most 8 GPUs but the job asks for 9 per node"),
                          ((2, 8, 32, 60), "at most 16 CPUs but the job asks for 32"),
                          ((2, 4, 8, 601), "allows at most 600 min (MaxTime)")):
        with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
            check_request(part, *args)
    assert default_time(part) == 600
    assert default_time(Partition("gpu", 16, 8, 64, None)) == 24 * 60   # hours, not 5 min
    assert [parse_minutes(t) for t in ("UNLIMITED", "2-00:00:00", "04:30:00", "30:00", "45")] \
        == [None, 2880, 270, 30, 45]


def test_submitted_says_the_time_limit_and_the_requeue_lead():
    from pivotrl_hpc.launch.submit import Submitted

    assert Submitted(1440, True, 120).describe() == (
        "time limit 24:00:00 (the default; --time sets it); 120 s before it the job "
        "checkpoints and requeues itself")
    assert "(asked for)" in Submitted(90, False, 120).describe()


def test_submitit_counts_one_task_for_a_job_on_many_nodes(tmp_path):
    """Only the batch step runs PivotJob: submitit must wait for one result, not one per
    node (a 2-node job's result() raised 'has not produced any output')."""
    from pivotrl_hpc.launch.submit import _executor

    ex = _executor(tmp_path, None)
    ex.update_parameters(ntasks_per_node=1, additional_parameters={"nodes": 2})
    assert ex._num_tasks() == 1
    text = ex._make_submission_file_text("true", "x")
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=1" in text


def test_resume_path_is_taken_from_the_submit_directory(tmp_path):
    from pivotrl_hpc.launch.resume import absolute_resume

    assert absolute_resume(["rl.steps=4", "resume=runs/pivotrl-49", "resume=auto",
                            "resume=/abs/x"], tmp_path) == [
        "rl.steps=4", f"resume={tmp_path}/runs/pivotrl-49", "resume=auto", "resume=/abs/x"]


def test_a_resumed_job_continues_in_the_run_folder_of_its_checkpoint(tmp_path):
    from pivotrl_hpc.launch.resume import continue_in, earlier_runs

    run = tmp_path / "runs" / "pivotrl-49"
    _checkpoint(layout.root_for(run / "tiny-cpu.h5"), 4)
    for where in (run, run / "tiny-cpu.h5", run / "tiny-cpu.checkpoints" / "step-000004"):
        assert continue_in(str(where)) == run / "tiny-cpu.h5"
    assert continue_in("auto") is None and continue_in(False) is None
    note = earlier_runs(run.parent, "pivotrl", "tiny-cpu.h5", run.parent / "pivotrl-53")
    assert note.startswith(f"{run} holds checkpoints of this config (newest step-000004)")
    assert f"pivotrl resume {run}" in note
    assert earlier_runs(run.parent, "pivotrl", "learn-cpu.h5", run.parent / "x") is None
    assert earlier_runs(run.parent, "other", "tiny-cpu.h5", run.parent / "x") is None
    (run.parent / "pivotrl-50").mkdir()          # a run that wrote no checkpoint
    (run.parent / "pivotrl-50" / "tiny-cpu.h5").write_bytes(b"")
    with pytest.raises(LaunchError, match="the run has no checkpoint"):
        continue_in(str(run.parent / "pivotrl-50"))


def test_a_run_without_checkpoints_says_which_setting_makes_them(tmp_path):
    """`pivotrl export TRACE` of a run that wrote none: not 'expected ... a run's trace .h5'
    (a trace was given) but that it has none, with what it ran with and what to set."""
    trace = tmp_path / "run" / "x.h5"
    trace.parent.mkdir()
    trace.write_bytes(b"")
    trace.with_suffix(".config.json").write_text(json.dumps({"rl": {"checkpoint_every": 0}}))
    for where in (trace, trace.parent):
        with pytest.raises(CheckpointError) as e:
            layout.find(where)
        assert "the run has no checkpoint (it ran with rl.checkpoint_every=0: periodic " \
               "checkpoints were off); set rl.checkpoint_every=N" in str(e.value)
        assert "expected" not in str(e.value)


def test_a_start_removes_the_partial_checkpoints_an_earlier_start_left(tmp_path):
    from pivotrl_hpc.checkpoint.state import prepare
    from pivotrl_hpc.config.load import load_config

    trace = tmp_path / "x.h5"
    root = layout.root_for(trace)
    whole = _checkpoint(root, 2)
    half = writer.staging(root, 4)                 # scancel while writing step 4
    cfg = load_config(None, [f"trace.path={trace}", "resume=false"], check_files=False)
    assert prepare(cfg) is None
    assert not half.exists() and whole.exists()


def test_a_rank_that_died_before_its_log_is_reported_with_srun_log(tmp_path):
    """No venv: every rank dies at import, before opening rank-N.log; the line names what it
    printed (in srun.log) and points there, not at a log that does not exist."""
    from pivotrl_hpc.launch.diagnose import diagnose

    paths = RunPaths(tmp_path / "run" / "x.h5")
    paths.logs.mkdir(parents=True)
    srun = ("Traceback (most recent call last):\n  File \"<frozen runpy>\", line 189\n"
            "ModuleNotFoundError: No module named 'mpi4py'\n"
            "srun: error: n2: task 5: Exited with exit code 1\n")
    text = diagnose(RankLayout(2, 4, ("n1", "n2")), paths, srun, 1, "srun")
    assert text.startswith("rank 5 (GPS agent")
    assert "before opening its log (ModuleNotFoundError: No module named 'mpi4py')" in text
    assert text.endswith(f"see {paths.logs / 'srun.log'}") and "rank-5.log" not in text


def test_job_error_is_the_raised_line_not_the_log_paths():
    from pivotrl_hpc.cli.submit import job_error

    text = ("Job (task=0) failed during processing with trace:\n----------------------\n"
            "Traceback (most recent call last):\n  File \"x.py\", line 3, in f\n"
            "    raise SlurmJobError(msg)\n"
            "pivotrl_hpc.launch.slurm.SlurmJobError: job 17: rank 7 (worker of device 5, node "
            "n2), host n2, role reward failed: RuntimeError: boom; log /r/rank-7.log\n\n"
            "----------------------\nYou can check full logs with 'job.stderr(0)' and "
            "'job.stdout(0)'or at paths:\n  - /r/submitit/17_0_log.err\n")
    assert job_error(text) == ("job 17: rank 7 (worker of device 5, node n2), host n2, role "
                               "reward failed: RuntimeError: boom; log /r/rank-7.log")


def test_a_runs_resolved_config_loads_as_the_config_of_its_resume(tmp_path):
    """`pivotrl resume` submits the run's <name>.config.json: JSON, whose 1e-07 YAML would
    read as a string."""
    from pivotrl_hpc.config.load import load_config
    from pivotrl_hpc.launch.local import resolved_config

    cfg = load_config(None, ["throughput.policy.A=1.0e-7"], check_files=False)
    config, paths = resolved_config(cfg, tmp_path / "run" / "x.h5")
    paths.config_json.parent.mkdir()
    paths.config_json.write_text(json.dumps(config))
    again = load_config(paths.config_json, ["rl.steps=9"], check_files=False)
    assert again.throughput.policy.A == 1e-7 and again.rl.steps == 9
    assert again.trace.path == str(tmp_path / "run" / "x.h5")


def test_checkpoint_now_asks_only_the_run_being_driven(tmp_path):
    """submitit's timeout hook (`checkpoint_now`) reaches the run `launch.slurm.execute`
    drives, and only while it drives it (`resume.driving`: the one owner of that state)."""
    from types import SimpleNamespace

    from pivotrl_hpc.launch.resume import checkpoint_now, driving

    logs = tmp_path / "run" / "job.logs"
    logs.mkdir(parents=True, mode=0o700)
    run = SimpleNamespace(paths=SimpleNamespace(trace=tmp_path / "run" / "job.h5", logs=logs))
    request = logs / layout.REQUEST_FILE
    assert checkpoint_now(0.0) is None and not request.exists()   # nothing driven
    with driving(run):
        assert checkpoint_now(0.0) is None   # no checkpoint came: the newest (none) so far
        assert request.read_text() == "checkpoint\n"
    request.unlink()
    assert checkpoint_now(0.0) is None and not request.exists()   # the run is done
