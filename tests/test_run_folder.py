"""A run folder's owner, without a job: what `resume=false` refuses and `resume=fresh_aside`
moves (launch.resume), and the refusals `pivotrl run` makes before any rank starts (a real
CLI process: wandb online without a key). The jobs themselves: test_run_folder_live.py."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from live_util import ROOT, model_overrides

from pivotrl_hpc.launch.layout import LaunchError
from pivotrl_hpc.launch.resume import check_owner, held_run, move_aside


def _earlier_run(folder: Path) -> Path:
    """A run's files as a job leaves them: two trace segments, a whole checkpoint, logs."""
    trace = folder / "x.h5"
    ckpt = folder / "x.checkpoints" / "step-000004"
    (ckpt / "policy").mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"step": 4, "version": 4}))
    (ckpt / "COMPLETE").write_text("{}")
    (folder / "x.logs").mkdir()
    (folder / "x.logs" / "rank-0.log").write_text("log\n")
    for name in ("x.h5", "x.seg1.h5", "x.summary.json", "x.config.json"):
        (folder / name).write_text(name)
    (folder / "y.h5").write_text("another run's trace: stays")
    return trace


def test_resume_false_is_refused_over_an_earlier_run_and_fresh_aside_moves_it(tmp_path):
    trace = _earlier_run(tmp_path)
    assert held_run(trace) == "trace x.h5 + 1 later segment(s) and checkpoints up to step-000004"
    for resume in (False, "false"):
        with pytest.raises(LaunchError, match=r"holds an earlier run of x.h5 .*resume=auto "
                                              r"continues it, a new trace.path"):
            check_owner(resume, trace)
    check_owner("auto", trace)          # a resume, not a fresh start
    check_owner(False, tmp_path / "new.h5")   # nothing of that name there
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*")
              if p.is_file()}
    old_umask = os.umask(0)   # the folder's mode is set, not left to the umask
    try:
        old = move_aside(trace)
        again = move_aside(_earlier_run_again(tmp_path))
    finally:
        os.umask(old_umask)
    assert old.name.startswith("old-") and old.parent == tmp_path and again != old
    assert stat.S_IMODE(old.stat().st_mode) == 0o700
    after = {p.relative_to(old): p.read_bytes() for p in old.rglob("*") if p.is_file()}
    assert after == {k: v for k, v in before.items() if k.name != "y.h5"}   # intact
    assert held_run(trace) is None and (tmp_path / "y.h5").is_file()
    assert move_aside(tmp_path / "none.h5") is None


def _earlier_run_again(folder: Path) -> Path:
    (folder / "x.h5").write_text("a second run")
    return folder / "x.h5"


def _dry_run(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    models = ROOT / ".run" / "models"
    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "run",
           str(ROOT / "configs" / "learn-cpu.yaml"), *model_overrides(models),
           f"trace.path={tmp_path / 'run' / 'x.h5'}", "trace.loggers=[console,wandb]",
           "--dry-run"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**clean, "HOME": str(tmp_path), **env})


@pytest.mark.skipif(not (ROOT / ".run" / "models" / "data" / "train.parquet").exists(),
                    reason="needs the tiny models (make run)")
def test_wandb_online_without_a_key_is_refused_before_start(tmp_path):
    p = _dry_run(tmp_path, {})
    assert p.returncode == 2, p.stdout + p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert "wandb runs online and has no key" in line and "WANDB_MODE=offline" in line
    assert not (tmp_path / "run").exists()
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password k\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert _dry_run(tmp_path, {}).returncode == 0          # `wandb login`'s entry
    (tmp_path / ".netrc").unlink()
    assert _dry_run(tmp_path, {"WANDB_MODE": "offline"}).returncode == 0


RAISING = '''def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = solution_str.split("Answer:")[1].strip()   # IndexError when there is none
    return 1.0 if answer == ground_truth else -1.0
'''


def test_a_raising_reward_function_is_named_or_scored_by_default(tiny_models, tmp_path):
    from pivotrl_hpc.config import load_config
    from pivotrl_hpc.task.errors import RewardFunctionError
    from pivotrl_hpc.task.task import build_task

    (tmp_path / "my_reward.py").write_text(RAISING)
    fn = f"reward.verifiable={tmp_path / 'my_reward.py'}:compute_score"
    config = ROOT / "configs" / "tiny-cpu.yaml"
    task, train, _ = build_task(load_config(config, [*model_overrides(tiny_models), fn]))
    prompt = train[3]
    source = task.records[prompt.pid].data_source
    none = task.policy.encode("no answer here")
    with pytest.raises(RewardFunctionError) as e:
        task.verdict(prompt, none)
    assert f"{tmp_path / 'my_reward.py'}:compute_score raised IndexError" in str(e.value)
    assert f"on prompt {prompt.pid} (data_source {source!r})" in str(e.value)
    assert "reward.on_error=default" in str(e.value)
    task, train, _ = build_task(load_config(config, [
        *model_overrides(tiny_models), fn, "reward.on_error=default",
        "reward.verifiable_default=-0.5"]))
    verdict = task.verdict(train[3], none)
    assert (verdict.score, verdict.correct, task.reward_errors) == (-0.5, False, 1)


def _checkpoint(root: Path, step: int, run: str | None) -> Path:
    from pivotrl_hpc.checkpoint import layout, writer

    tmp = writer.staging(root, step)
    (tmp / layout.POLICY).mkdir()
    writer.write_state(tmp, {"step": step, "version": step, "fixed": {},
                             **({"run": run} if run else {})})
    return writer.commit(tmp, keep=2)


def test_pruning_keeps_to_the_committing_runs_own_checkpoints(tmp_path):
    """An earlier run's steps 8 and 10 (no run id, as written before ids) beside a new run
    whose step 1 is the oldest: the new run's commits drop only its own."""
    from pivotrl_hpc.checkpoint import layout

    root = tmp_path / "x.checkpoints"
    for step in (6, 8, 10):
        _checkpoint(root, step, None)
    names = lambda: [p.name for p in layout.whole(root)]   # noqa: E731
    assert names() == ["step-000008", "step-000010"]      # the old run pruned its own
    for step in (1, 2, 3):
        _checkpoint(root, step, "newrun")
    assert names() == ["step-000002", "step-000003", "step-000008", "step-000010"]
    _checkpoint(root, 4, "other")                          # a third run keeps all of theirs
    assert names() == ["step-000002", "step-000003", "step-000004", "step-000008",
                       "step-000010"]


def test_submit_refuses_without_slurm_as_the_cli_does(monkeypatch, tmp_path):
    import pivotrl_hpc

    # the one fault a machine with Slurm cannot give on demand: no sbatch on PATH
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match="sbatch is not on PATH"):
        pivotrl_hpc.submit(ROOT / "configs" / "tiny-cpu.yaml", check=False,
                           runs_root=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_a_slurm_jobs_preflight_does_not_resume_the_local_trace_path(tiny_models, tmp_path):
    """Under Slurm a job writes runs/<name>-<id>/: a checkpoint of another config at the
    local trace.path is not its own, so only `pivotrl run`'s preflight refuses it."""
    from pivotrl_hpc.checkpoint import layout, writer
    from pivotrl_hpc.config import ConfigError, load_config
    from pivotrl_hpc.launch.preflight import preflight, preflight_slurm

    trace = tmp_path / "out" / "x.h5"
    tmp = writer.staging(layout.root_for(trace), 2)
    (tmp / layout.POLICY).mkdir()
    writer.write_state(tmp, {"step": 2, "version": 2, "fixed": {"rl.batch_size": 99}})
    writer.commit(tmp, keep=2)
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml",
                      [*model_overrides(tiny_models), f"trace.path={trace}"])
    with pytest.raises(ConfigError, match="made with rl.batch_size=99"):
        preflight(cfg)
    preflight_slurm(cfg)                                  # a new job's folder is its own
    cfg.resume = str(trace)                               # resume=PATH: still checked
    with pytest.raises(ConfigError, match="made with rl.batch_size=99"):
        preflight_slurm(cfg)
