"""`pivotrl trace check`: a simulated run's trace passes every invariant of docs/trace.md,
and a copy of it broken on purpose (rewritten with the TraceWriter, one thing changed) fails
the invariant that guards it. Also: the doc's tables equal the schema, column by column."""
from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
from live_util import model_overrides

from pivotrl_hpc.config import load_config
from pivotrl_hpc.sim.run import SimConstants, simulate
from pivotrl_hpc.trace import TABLES, TraceWriter
from pivotrl_hpc.trace.check import INVARIANTS, check, read

ROOT = Path(__file__).resolve().parents[1]
NAMES = [name.split(":")[0] for name, _ in INVARIANTS]


@pytest.fixture(scope="module")
def run(tiny_models, tmp_path_factory):
    """A shiftable run with shifts, migrations, reloads and a held admission (k = 1)."""
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml",
                      [*model_overrides(tiny_models), "rl.steps=4", "rl.staleness=1"])
    path = tmp_path_factory.mktemp("check") / "run.h5"
    simulate(cfg, SimConstants.from_config(cfg), path)
    return path, read(path)


def failed(path: Path) -> set[str]:
    return {r.name.split(":")[0] for r in check(path) if not r.ok}


def broken(run, tmp_path, edit) -> Path:
    """The run's trace rewritten with `edit(rows, summary)` applied."""
    _, (rows, meta, summary, _) = run
    rows, summary = copy.deepcopy(rows), copy.deepcopy(summary)
    edit(rows, summary)
    out = tmp_path / "broken.h5"
    with TraceWriter(out, meta) as w:
        for table, table_rows in rows.items():
            for row in table_rows:
                w.append(table, **row)
        w.close(summary)
    return out


def first(rows: list[dict], **match) -> dict:
    return next(r for r in rows if all(r[k] == v for k, v in match.items()))


def test_the_run_passes_every_invariant_and_the_cli_says_so(run):
    path, (rows, _, summary, _) = run
    assert all(r.ok for r in check(path)), [r.line() for r in check(path)]
    events = {r["event"] for r in rows["sequences"]}
    # the run exercises what the invariants are about
    assert {"admit", "dispatch", "migrate", "abort", "finish", "reward", "train"} <= events
    assert rows["reloads"] and rows["work"] and summary["staleness_held_s"] > 0
    assert rows["planner"][0]["plan_id"] == 0 and rows["planner"][0]["executed"] == 1
    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "trace", "check",
                        str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("\n  ok ") == len(INVARIANTS)


def test_a_rewritten_copy_still_passes(run, tmp_path):
    """The rewriting itself breaks nothing: each failure below is the edit's."""
    assert failed(broken(run, tmp_path, lambda rows, summary: None)) == set()


def _retype_step_numbers(rows, summary):   # the old convention: steps from 1
    for s in rows["steps"]:
        s["step"] += 1


def _unexecuted_plan_id(rows, summary):    # the old planner rows: -1 when not executed
    first(rows["planner"], executed=0)["plan_id"] = -1


def _migrate_from_the_queue(rows, summary):   # the old label of a shift-up dispatch
    first(rows["sequences"], event="dispatch", role="rollout")["event"] = "migrate"


def _abort_after_two_steps(rows, summary):
    """The source's abort comes after it answered two more Steps."""
    seqs = rows["sequences"]
    for r in seqs:
        if r["event"] == "abort":
            later = [w["t"] for w in rows["work"] if w["replica"] == r["replica"]
                     and w["t"] > r["t"]]
            if len(later) >= 2:
                r["t"] = later[1]
                return
    raise AssertionError("no abort with two later Steps of its replica")


def _step_tokens(rows, summary):
    rows["steps"][1]["tokens"] += 1


def _training_throughput_zero(rows, summary):   # the old hard-coded 0.0
    first(rows["timeseries"], role="training",
          tokens_per_s=next(r["tokens_per_s"] for r in rows["timeseries"]
                            if r["role"] == "training" and r["tokens_per_s"] > 0)
          )["tokens_per_s"] = 0.0


def _abort_keeps_more_than_resumed(rows, summary):
    r = first(rows["sequences"], event="abort")
    r["tokens"] += 1000


def _second_finish(rows, summary):
    rows["sequences"].append(dict(first(rows["sequences"], event="finish", role="reward")))


def _lag_beyond_k_at_training(rows, summary):
    r = first(rows["sequences"], event="train", step=3)
    r["version"] = 1   # lag 2 > k = 1


def _admission_ahead_of_a_served_version(rows, summary):
    rows["admission"][-1]["version"] += 1


def _admit_beyond_k(rows, summary):
    r = first(rows["sequences"], event="admit", role="rollout", step=3)
    r["version"] = 1


def _device_in_two_roles(rows, summary):
    up = first(rows["shifts"], direction="up", role="reward")
    rows["shifts"].insert(rows["shifts"].index(up) + 1,
                          dict(up, role="rollout", replica="rollout-x"))


def test_a_shift_down_in_flight_at_a_cancel_still_stops_its_replica_serving(run, tmp_path):
    """A Slurm cancel can end a job between a plan shifting a rollout replica down and the
    workers' answer, so the trace has the executed plan but no shifts `down` row; admissions
    after the plan no longer count that replica's older version (CI failure, issue 47)."""
    def edit(rows, summary):
        downs = [s for s in rows["shifts"] if s["role"] == "rollout"
                 and s["direction"] == "down"]
        for s in downs:
            rows["shifts"].remove(s)
        rows["reloads"][:] = [r for r in rows["reloads"]
                              if r["replica"] not in {s["replica"] for s in downs}]
        assert downs
    assert "staleness" not in failed(broken(run, tmp_path, edit))


@pytest.mark.parametrize("edit, invariant", [
    (_retype_step_numbers, "numbering"), (_unexecuted_plan_id, "numbering"),
    (_step_tokens, "tokens"), (_training_throughput_zero, "tokens"),
    (_abort_keeps_more_than_resumed, "tokens"), (_second_finish, "finish"),
    (_migrate_from_the_queue, "placement"), (_abort_after_two_steps, "placement"),
    (_lag_beyond_k_at_training, "staleness"), (_admit_beyond_k, "staleness"),
    (_admission_ahead_of_a_served_version, "staleness"), (_device_in_two_roles, "roles"),
])
def test_a_broken_trace_fails_its_invariant(run, tmp_path, edit, invariant):
    assert invariant in failed(broken(run, tmp_path, edit))


@pytest.mark.parametrize("figure", ["idle_fraction", "tau_shift", "staleness_held_s",
                                    "step_overhead_s", "first_step_s", "migrations",
                                    "in_flight_at_end", "steady_tokens_per_s", "shifts"])
def test_a_summary_figure_off_fails_summary(run, tmp_path, figure):
    def edit(rows, summary):
        value = summary[figure]
        if isinstance(value, dict):
            key = next(iter(value))
            value[key] = value[key] * 1.01 + 0.01
        else:
            summary[figure] = value + 1 if isinstance(value, int) else value * 1.01 + 0.01
    assert failed(broken(run, tmp_path, edit)) == {"summary"}


def test_a_trace_without_a_documented_table_fails_schema(run, tmp_path):
    path, _ = run
    copy_path = tmp_path / "old.h5"
    copy_path.write_bytes(path.read_bytes())
    import json
    with h5py.File(copy_path, "r+") as f:
        schema = json.loads(f.attrs["schema"])
        del schema["work"]
        f.attrs["schema"] = json.dumps(schema)
    assert failed(copy_path) == {"schema"}
    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "trace", "check",
                        str(copy_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "FAIL  schema" in p.stdout, p.stdout + p.stderr


def test_check_refuses_a_missing_file(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "trace", "check",
                        str(tmp_path / "none.h5")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no trace at" in p.stderr


def doc_tables() -> dict[str, dict[str, str]]:
    """docs/trace.md's `### `name`` sections: column -> type, in the doc's order."""
    text = (ROOT / "docs" / "trace.md").read_text()
    out = {}
    for m in re.finditer(r"^### `(\w+)`.*?\n(.*?)(?=^##)", text, re.S | re.M):
        cols = {}
        for row in re.finditer(r"^\| (`[^|]+) \| ([\w:]+) \|", m[2], re.M):
            for name in re.findall(r"`(\w+)`", row[1]):
                cols[name] = {"str": "str:64"}.get(row[2], row[2])
        out[m[1]] = cols
    return out


def test_the_doc_and_the_schema_agree_column_by_column():
    doc = doc_tables()
    assert list(doc) == list(TABLES)
    for table, columns in TABLES.items():
        rest = {c: t for c, t in columns.items() if c != "t"}   # `t` is documented once
        assert list(doc[table].items()) == list(rest.items()), table


def test_migrations_are_counted_from_migrate_rows_only(run, tiny_models, tmp_path):
    """Disaggregated with one rollout (TP=2) and one reward replica never shifts and has no
    second replica to move a sequence to: its sequences are only dispatched from the
    queue, so it counts no migration (the old trace labelled every placement at a shift up
    `migrate`); the shiftable run counts exactly its migrate rows, in its summary and in
    `pivotrl report`."""
    from pivotrl_hpc.report import numbers
    from pivotrl_hpc.trace import open_trace

    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml",
                      [*model_overrides(tiny_models), "rl.steps=2", "paradigm.name=disaggregated",
                       "paradigm.initial_rollout_devices=2", "paradigm.initial_reward_devices=2",
                       "roles.rollout_replica_size=2", "models.policy.tensor_parallel=2"])
    path = tmp_path / "disaggregated.h5"
    summary = simulate(cfg, SimConstants.from_config(cfg), path)
    with open_trace(str(path)) as t:
        events = list(t.table("sequences")["event"])
        assert numbers(t)["migrations"] == 0 == summary["migrations"]
    assert events.count("dispatch") > 0 and "migrate" not in events
    assert all(r.ok for r in check(path))
    shiftable, (rows, _, run_summary, _) = run
    moved = sum(r["event"] == "migrate" for r in rows["sequences"])
    with open_trace(str(shiftable)) as t:
        assert numbers(t)["migrations"] == moved == run_summary["migrations"] > 0


def _modeled(tmp_path, name: str, resume_from=None, version: int = 0) -> Path:
    """A disaggregated job on modeled workers that checkpoints every 2 steps, traced; with
    `resume_from`, the segment that starts from that checkpoint (test_checkpoint's run)."""
    from controller_util import make_controller, split_bootstrap

    from pivotrl_hpc.controller.checkpointing import Checkpointer, resume

    ctl, workers = make_controller("disaggregated", gpus=8, train=(0, 1, 2, 3), steps=6,
                                   staleness=1,
                                   params={"rollout_gpus": 2, "reward_gpus": 2},
                                   bootstrap=split_bootstrap())
    workers[0].store.version = version
    meta = {"resumed_from": str(resume_from or "")}
    path = tmp_path / f"{name}.h5"
    with TraceWriter(path, meta) as w:
        ctl.trace = ctl.report.trace = ctl.executor.trace = w
        ctl.checkpoints = Checkpointer(tmp_path / f"{name}.checkpoints", 2, 10,
                                       {"rl.batch_size": 4, "rl.steps": 6})
        if resume_from is not None:
            resume(ctl, resume_from)
        w.close(ctl.run())
    return path


def test_a_resumed_segment_passes(tmp_path):
    """The first segment and one resumed from its step-4 checkpoint (steps numbered as in
    the run, samples from the checkpoint requeued, tau_shift and the held seconds carried
    on from the `start` row) both hold every invariant."""
    full = _modeled(tmp_path, "full")
    resumed = _modeled(tmp_path, "resumed", tmp_path / "full.checkpoints" / "step-000004", 4)
    rows, meta, summary, _ = read(resumed)
    assert [s["step"] for s in rows["steps"]] == [4, 5] and summary["steps"] == 6
    for path in (full, resumed):
        assert all(r.ok for r in check(path)), [r.line() for r in check(path) if not r.ok]


@pytest.mark.parametrize("plan_1_at, ok", [(5.0, True), (6.1, False)])
def test_a_device_up_before_the_row_of_its_multi_device_down(tmp_path, plan_1_at, ok):
    """Devices 2-3 (a TP=2 reward replica) shift down for rollout on device 2: device 2
    answers first and is up (row at 6.0) before device 3's answer writes the down row
    (6.2). Allowed when the down's plan started before the up ended, not otherwise."""
    from pivotrl_hpc.trace.check import roles

    path = tmp_path / "tp2.h5"
    with TraceWriter(path, {}) as w:
        for plan_id, t in ((0, 0.0), (1, plan_1_at)):
            w.append("planner", t=t, plan_id=plan_id, executed=1)
        w.append("shifts", t=1.0, plan_id=0, direction="up", role="reward", devices="2,3")
        w.append("shifts", t=6.0, plan_id=1, direction="up", role="rollout", devices="2")
        w.append("shifts", t=6.2, plan_id=1, direction="down", role="reward", devices="2,3")
        w.append("shifts", t=7.0, plan_id=1, direction="down", role="rollout", devices="2")
    rows, meta, summary, schema = read(path)
    assert (roles(rows, meta, summary, schema) == []) == ok


@pytest.mark.parametrize("plan_downs, more_rows, ok", [
    (["training"], False, True), ([], False, False), (["training"], True, False)])
def test_a_stop_with_a_multi_device_down_in_flight(tmp_path, plan_downs, more_rows, ok):
    """CI failure (test_slurm_requeue): colocated plan 1 shifts the trainer (devices 0-3)
    down for rollout; devices 1-2 answered and are up in rollout when the requeue's SIGTERM
    ends the job, so the trainer's down row (written at its last device's answer) never
    comes. Allowed where the up's own executed plan shifts the held replica down and the
    trace ends first; not where the plan does not, nor where the device has later rows."""
    from pivotrl_hpc.trace.check import roles

    path = tmp_path / "stopped.h5"
    candidates = [{"shift_down": plan_downs, "shift_up": []}]
    with TraceWriter(path, {}) as w:
        for plan_id, t in ((0, 0.0), (1, 5.0)):
            w.append("planner", t=t, plan_id=plan_id, executed=1, chosen=plan_id - 1,
                     candidates=candidates if plan_id else [])
        w.append("shifts", t=1.0, plan_id=0, direction="up", role="training",
                 replica="training", devices="0,1,2,3")
        for d in (1, 2):
            w.append("shifts", t=6.0, plan_id=1, direction="up", role="rollout",
                     replica=f"rollout{d}", devices=str(d))
        if more_rows:
            w.append("shifts", t=7.0, plan_id=1, direction="down", role="rollout",
                     replica="rollout1", devices="1")
    rows, meta, summary, schema = read(path)
    assert (roles(rows, meta, summary, schema) == []) == ok
