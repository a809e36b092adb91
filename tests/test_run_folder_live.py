"""One run folder through its life, with real `pivotrl run` jobs (learn-cpu, colocated on 2
devices of 0.8 cores, a checkpoint after each step, TensorBoard and wandb offline):

0. Ctrl-C while the ranks start (engines building): the job ends in seconds, quietly;
1. a 2-step run finishes; `rl.staleness=2` is written as a colocated user would leave it
   (the paradigm makes it 0, which its checkpoints record);
2. the same command again: "already complete at step 2 of 2", exit 0 before any rank
   starts, not a file of the folder changed (the preflight compares the checkpoint with the
   staleness the paradigm implies, not the 2 written);
3. `resume=false` there: refused in one line naming the trace and the checkpoints and the
   ways on, nothing changed;
4. `rl.steps=5` resumes it (a second segment); Ctrl-C once step 3's checkpoint is whole: the
   summary is written and the console prints the command that continues the run;
5. that command, as printed, resumes from the newest checkpoint and finishes (a third
   segment): the summary and `pivotrl report` cover all three segments, TensorBoard has one
   folder with continuous steps, wandb one run id;
6. `resume=fresh_aside rl.steps=1`: the earlier run moved intact to `old-<time>/`, the
   console says so. Every start but this one scores the responses its reward function
   raises on by `reward.on_error: default` (counted); this one raises: the console line
   names the function, the sample and its data source.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from live_util import ROOT, model_overrides, run_job

# the fixture runs five starts of a job and a stopped one: ~6 min quiet, ~25 at load 30
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

COLOCATED = ["paradigm.name=colocated", "cluster.devices_per_node=2", "cluster.cpu_share=0.8",
             "paradigm.initial_rollout_devices=1", "rl.staleness=2", "rl.batch_size=4",
             "rl.checkpoint_every=1", "rl.steps=2",
             "trace.loggers=[console,tensorboard,wandb]"]   # wandb offline (the fixture)


def _pivotrl_run(models: Path, trace: Path, job: list[str],
                 *overrides: str) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "run",
           str(ROOT / "configs" / "learn-cpu.yaml"), *model_overrides(models),
           f"trace.path={trace}", *job, *overrides]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "UCX_MODULES": "^ib,rdmacm"})
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


RAISING = '''def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = solution_str.split("Answer:")[1].strip()   # IndexError when there is none
    return 1.0 if answer == ground_truth else -1.0
'''


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and modification time (ns)."""
    return {str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def life(tiny_models, tmp_path_factory) -> dict:
    before = os.environ.get("WANDB_MODE")
    os.environ["WANDB_MODE"] = "offline"   # the jobs inherit it
    try:
        return _life(tiny_models, tmp_path_factory.mktemp("life") / "run.h5")
    finally:
        if before is None:
            os.environ.pop("WANDB_MODE")
        else:
            os.environ["WANDB_MODE"] = before


def _one_run(folder: Path, report: Path) -> dict:
    """What a run of two segments left: its TensorBoard folders, the steps of each event
    file, its wandb runs' ids and `pivotrl report`'s Markdown of the second segment."""
    from test_tensorboard import read_event_file, scalars

    from pivotrl_hpc.report import write_report

    write_report(folder / "run.seg2.h5", report)
    return {"tb_folders": sorted(p.name for p in folder.glob("*.tensorboard")),
            "tb_steps": sorted(sorted(scalars(read_event_file(f))) for f in
                               (folder / "run.tensorboard").glob("events.out.tfevents.*")),
            "wandb_ids": sorted(p.name.rsplit("-", 1)[1]
                                for p in (folder / "wandb").glob("offline-run-*")),
            "report": (report / "summary.md").read_text()}


def _life(tiny_models: Path, trace: Path) -> dict:
    from pivotrl_hpc.checkpoint.layout import root_for, segments

    folder = trace.parent
    out: dict = {"trace": trace}
    # a reward function that raises on a response without "Answer:" (nearly every one of
    # the random-weight policy's), scored by reward.on_error=default until the last start
    fn = folder.parent / "my_reward.py"
    fn.write_text(RAISING)
    job = [*COLOCATED, f"reward.verifiable={fn}:compute_score", "reward.on_error=default"]
    out["reward_fn"] = f"{fn}:compute_score"
    out["startup"] = _stopped_starting(tiny_models, folder.parent / "startup" / "run.h5", job)
    out["first"] = run_job("learn-cpu.yaml", tiny_models, trace, job)
    before = _files(folder)
    out["again"] = (*_pivotrl_run(tiny_models, trace, job), before == _files(folder))
    out["false"] = (*_pivotrl_run(tiny_models, trace, job, "resume=false"),
                    before == _files(folder))
    # rl.steps=5 continues it; Ctrl-C once step 3's checkpoint is whole; the command it
    # prints continues it to the end
    out["stopped"] = _interrupted(tiny_models, trace, root_for(trace) / "step-000003", job)
    out["resumed"] = _printed_command(out["stopped"]["output"])
    out["resumed"]["segments"] = [p.name for p in segments(trace)]
    out["one_run"] = _one_run(folder, folder.parent / "report")
    # afresh, the earlier run moved aside; on_error=raise: the first reward ends the job
    out["aside"] = dict(zip(("code", "output", "seconds"), _pivotrl_run(
        tiny_models, trace, job, "rl.steps=1", "resume=fresh_aside", "reward.on_error=raise")))
    return out


def _stopped_starting(models: Path, trace: Path, job: list[str]) -> dict:
    """Ctrl-C once every rank is up, while the engines build: the seconds to the exit."""
    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "run",
           str(ROOT / "configs" / "learn-cpu.yaml"), *model_overrides(models),
           f"trace.path={trace}", *job]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "UCX_MODULES": "^ib,rdmacm"})
    logs = trace.with_suffix(".logs")
    deadline = time.monotonic() + 600
    while len(list(logs.glob("rank-*.pid"))) < 3:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the ranks did not start within 600 s"
        time.sleep(0.2)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    seconds = time.monotonic() - t0
    # the ranks the launcher killed: gone a moment later (a SIGKILLed one may still be
    # exiting when mpirun has ended)
    pids = [int(p.read_text().split()[0]) for p in logs.glob("rank-*.pid")]
    deadline = time.monotonic() + 5
    while (left := [pid for pid in pids if _a_rank(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return {"code": proc.returncode, "output": output, "seconds": seconds, "left": left}


def _a_rank(pid: int) -> bool:
    try:
        return b"pivotrl_hpc.launch.entry" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _interrupted(models: Path, trace: Path, after: Path, job: list[str]) -> dict:
    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "run",
           str(ROOT / "configs" / "learn-cpu.yaml"), *model_overrides(models),
           f"trace.path={trace}", *job, "rl.steps=5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "UCX_MODULES": "^ib,rdmacm"})
    deadline = time.monotonic() + 600
    while not (after / "COMPLETE").exists():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"no {after.name} within 600 s"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)   # Ctrl-C
    output = proc.communicate(timeout=300)[0]
    summary = trace.with_suffix(".summary.json")
    return {"code": proc.returncode, "output": output,
            "summary": json.loads(summary.read_text()) if summary.is_file() else None}


def _printed_command(output: str) -> dict:
    """Run the command a stopped `pivotrl run` printed to continue (pivotrl as this
    interpreter's module)."""
    line = next(ln for ln in output.splitlines() if "to continue from step-" in ln)
    cmd = shlex.split(line.split(": ", 2)[2])
    assert cmd[:2] == ["pivotrl", "run"], line
    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", *cmd[1:]],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "UCX_MODULES": "^ib,rdmacm"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    trace = Path(next(o for o in cmd if o.startswith("trace.path=")).split("=", 1)[1])
    return {"line": line, "output": p.stdout + p.stderr,
            "summary": json.loads(trace.with_suffix(".summary.json").read_text())}


def test_a_finished_run_started_again_does_nothing(life):
    code, output, seconds, unchanged = life["again"]
    assert code == 0, output[-3000:]
    assert "already complete at step 2 of 2" in output, output[-3000:]
    assert unchanged   # not a file of the run folder written, moved or removed
    assert "ranks, logs in" not in output     # no rank started
    assert seconds < 45, seconds   # no task built, no rank started


def test_resume_false_over_an_earlier_run_is_refused(life):
    code, output, _, unchanged = life["false"]
    assert code == 2, output[-3000:]
    line = output.strip().splitlines()[-1]
    assert line.startswith("pivotrl run: ") and "trace run.h5" in line and \
        "checkpoints up to step-000002" in line, output[-3000:]
    assert "resume=auto" in line and "trace.path" in line and "resume=fresh_aside" in line
    assert unchanged


def test_ctrl_c_writes_the_summary_and_prints_the_command_that_continues(life):
    stopped, resumed = life["stopped"], life["resumed"]
    assert stopped["code"] == 128 + signal.SIGINT, stopped["output"][-3000:]
    assert "resumed from" in stopped["output"]        # rl.steps=5 continued the finished run
    s = stopped["summary"]
    assert s is not None and s["stopped"].startswith("stopped by SIGTERM after step ")
    trained = int(s["stopped"].rsplit(" ", 1)[1])
    assert trained >= 3 and s["reward_per_step"][0]["step"] == 2
    assert "resume=auto" in resumed["line"] and "to continue from step-00000" in resumed["line"]
    assert f"summary {life['trace'].with_suffix('.summary.json')}" in resumed["line"]
    # the printed command resumed from the newest checkpoint and finished the run
    done = resumed["summary"]
    assert "stopped" not in done and done["steps"] == 5
    assert resumed["segments"] == ["run.h5", "run.seg1.h5", "run.seg2.h5"]


def test_ctrl_c_during_start_up_ends_quietly_in_seconds(life):
    st = life["startup"]
    assert st["code"] == 128 + signal.SIGINT, st["output"][-3000:]
    # the ranks' own watchdog alone took 20 s (and the launcher killed them at 30 s); 15.1 s
    # measured here at load ~50 (the kill at 3 s, then mpirun's end and the sweep)
    assert st["seconds"] < 20, (st["seconds"], st["output"][-3000:])
    assert "stopped by SIGINT during start-up" in st["output"]
    assert "still running" not in st["output"] and "ERROR" not in st["output"], st["output"]
    assert not st["left"]   # no rank outlived the launcher (by more than 5 s)


def test_fresh_aside_moves_the_earlier_run_intact(life):
    from pivotrl_hpc.checkpoint.layout import root_for, segments, whole

    trace, aside = life["trace"], life["aside"]
    folder = trace.parent
    olds = sorted(folder.glob("old-*"))
    assert len(olds) == 1, sorted(p.name for p in folder.iterdir())
    old = olds[0]
    assert f"moved to {old}" in aside["output"], aside["output"][-3000:]
    # the earlier run, whole: its three segments, its last two checkpoints, summary, logs
    assert [p.name for p in segments(old / "run.h5")] == ["run.h5", "run.seg1.h5",
                                                           "run.seg2.h5"]
    assert [p.name for p in whole(root_for(old / "run.h5"))] == ["step-000004",
                                                                  "step-000005"]
    assert json.loads((old / "run.summary.json").read_text()) == life["resumed"]["summary"]
    assert (old / "run.logs").is_dir() and (old / "run.config.json").is_file()
    assert (old / "run.tensorboard").is_dir()
    # the new run: its own trace (one segment), no checkpoint of the old one beside it
    assert [p.name for p in segments(trace)] == ["run.h5"]
    assert whole(root_for(trace)) == []


def test_a_raising_reward_function_is_named_on_the_console_or_scored_by_default(life):
    import re

    # reward.on_error=raise (the last start): the console line names the function, the
    # sample and its data source, and the rank and role that failed
    aside = life["aside"]
    assert aside["code"] == 1, aside["output"][-3000:]
    line = aside["output"].strip().splitlines()[-1]
    assert re.search(r"^pivotrl run: rank 0 \(.*controller.*\).* failed: RewardFunctionError: "
                     r"sample \d+: the reward function " + re.escape(life["reward_fn"]) +
                     r" raised IndexError: list index out of range on prompt \d+ "
                     r"\(data_source '[^']+'\)", line), line
    # (the end-of-job barrier's time-out that may follow, a worker busy in a command when
    # the controller failed, is not what the console names)
    assert "failed: TimeoutError" not in line
    # reward.on_error=default (every earlier start): scored, counted, the job finished
    first = life["first"]
    assert first["summary"]["reward_fn_errors"] > 0
    assert "reward function errors scored by reward.on_error=default: " in first["output"]


def test_a_resumed_run_is_one_run(life):
    resumed, one = life["resumed"], life["one_run"]
    s = resumed["summary"]
    names = ["run.h5", "run.seg1.h5", "run.seg2.h5"]
    assert [Path(g["trace"]).name for g in s["segments"]] == names
    first, stopped, last = (g["steps"] for g in s["segments"])
    assert first == [0, 1] and stopped[0] == 2 and last[-1] == 4
    assert last[0] == int(life["stopped"]["summary"]["stopped"].rsplit(" ", 1)[1]) or \
        last[0] <= stopped[-1] + 1   # from the newest checkpoint (a step may be redone)
    assert (s["run"]["segments"], s["run"]["steps"]) == (3, 5)
    assert sorted({r["step"] for r in s["run"]["reward_per_step"]}) == [0, 1, 2, 3, 4]
    assert "run of 3 segments: 5 steps trained" in resumed["output"]
    # one TensorBoard folder; an event file per segment, the steps continuing
    assert one["tb_folders"] == ["run.tensorboard"]
    assert one["tb_steps"] == [first, stopped, last]
    # one wandb run: every segment's offline run carries the same id
    ids = one["wandb_ids"]
    assert len(ids) == 3 and len(set(ids)) == 1, ids
    # pivotrl report of a segment lists all three and the run over them
    assert "| run.h5 | 0-1 |" in one["report"] and "| run.seg2.h5 |" in one["report"]
    assert "| run (3 segments) |" in one["report"]
