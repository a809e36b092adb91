"""Issue 48, points 4 and 5 and tracking: the samples a run keeps (the trace's `samples`
table, `trace.samples`, `pivotrl trace samples`), evaluation (val_accuracy in `steps` and
TensorBoard, rl.eval_before_train, the last step, accuracy per data source, the validation
file checked whenever it is set) and the wandb logger (offline)."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path

import pytest
from controller_util import make_controller
from live_util import model_overrides

from pivotrl_hpc.config import ConfigError, load_config
from pivotrl_hpc.trace import TraceWriter, open_trace
from pivotrl_hpc.trace.check import check

ROOT = Path(__file__).resolve().parents[1]


def _modeled(tmp_path, samples=4, before=False, steps=3, eval_every=2, loggers=()):
    """A modeled shiftable run with a trace; validation prompts from two data sources."""
    trace = TraceWriter(tmp_path / "run.h5", {}, tensorboard=tmp_path / "run.tensorboard",
                        loggers=loggers)
    ctl, _ = make_controller("shiftable", steps=steps, eval_every=eval_every, trace=trace)
    ctl.cfg = dataclasses.replace(ctl.cfg, eval_before_train=before, samples=samples)
    ctl.validation = [dataclasses.replace(p, data_source="aime" if i % 2 else "amc")
                      for i, p in enumerate(ctl.validation)]
    summary = ctl.run()
    trace.close(summary)
    return tmp_path / "run.h5", summary


def _table(path, name):
    with open_trace(path) as t:
        cols = t.table(name)
        return [{c: cols[c][i] for c in cols} for i in range(t.rows(name))]


def test_val_accuracy_in_steps_at_every_evaluation_the_last_and_before_training(tmp_path):
    path, summary = _modeled(tmp_path, before=True)
    # evaluated: before training (0), every 2 steps (2) and after the last (3)
    assert [v["step"] for v in summary["validation"]] == [0, 2, 3]
    steps = _table(path, "steps")
    val = {r["step"]: r["val_accuracy"] for r in steps}
    assert math.isnan(val[0])                          # the policy of step 0 is not evaluated
    assert val[1] == summary["validation"][1]["accuracy"]   # step 1 made the policy of "2"
    assert val[2] == summary["validation"][2]["accuracy"]
    rows = _table(path, "validation")
    assert [(r["step"], r["data_source"]) for r in rows] == [
        (k, src) for k in (0, 2, 3) for src in ("", "aime", "amc")]
    for k in (0, 2, 3):
        overall, *per = [r for r in rows if r["step"] == k]
        assert overall["samples"] == sum(r["samples"] for r in per) == 4
        assert overall["correct"] == sum(r["correct"] for r in per)
        assert all(r["accuracy"] == r["correct"] / r["samples"] for r in rows)
        got = next(v for v in summary["validation"] if v["step"] == k)
        assert got["by_source"] == {r["data_source"]: r["accuracy"] for r in per}
    for r in (r for r in rows if r["data_source"] == ""):   # the versions that generated it
        assert sum(r["versions"].values()) == r["samples"]
        assert all(int(v) >= r["step"] for v in r["versions"])
    assert all(r["versions"] is None for r in rows if r["data_source"])
    assert all(r.ok for r in check(path)), [r.line() for r in check(path) if not r.ok]


def test_val_accuracy_reaches_tensorboard(tmp_path):
    from test_tensorboard import read_events

    path, summary = _modeled(tmp_path, before=True)
    tags: dict[int, dict[str, float]] = {}
    for e in read_events(tmp_path / "run.tensorboard"):
        for v in e.summary.value:
            tags.setdefault(e.step, {})[v.tag] = v.simple_value
    acc = {v["step"]: v["accuracy"] for v in summary["validation"]}
    assert tags[1]["steps/val_accuracy"] == pytest.approx(acc[2])
    assert tags[2]["steps/val_accuracy"] == pytest.approx(acc[3])
    assert "steps/val_accuracy" not in tags[0]
    for k in (0, 2, 3):
        assert tags[k]["validation/accuracy/all"] == pytest.approx(acc[k])
        assert "validation/accuracy/aime" in tags[k] and "validation/accuracy/amc" in tags[k]


@pytest.mark.parametrize("setting,per_step", [(4, 4), (2, 2), ("all", 16), ("none", 0)])
def test_trace_samples_keeps_n_a_step_all_or_none(tmp_path, setting, per_step):
    path, summary = _modeled(tmp_path, samples=setting)
    rows = _table(path, "samples")
    train = [r for r in rows if r["kind"] == "train"]
    assert [sum(r["step"] == s for r in train) for s in range(3)] == [per_step] * 3
    evals = [r for r in rows if r["kind"] == "eval"]
    assert len(evals) == min(per_step, 4) * 2        # two evaluations of 4 samples
    steps = _table(path, "steps")
    for r in train:   # the first samples of the step (a group), with the step's scores
        sids = [sid for _, sid in steps[r["step"]]["prompts"]]
        assert r["sample"] in sids[:per_step]
        assert r["reward"] == pytest.approx(0.5 * (r["verifiable"] + r["genrm"])) or \
            r["reward"] == pytest.approx(r["verifiable"] + r["genrm"])
        assert r["parse"] in ("parsed", "unparsed") and r["judge_tokens"] > 0
        assert r["response_tokens"] > 0 and r["prompt_tokens"] > 0 and r["version"] >= 0
    for r in evals:
        assert r["correct"] in (0, 1) and r["data_source"] in ("aime", "amc")
        assert r["parse"] == "" and r["judge_tokens"] == 0


def test_samples_of_a_simulated_run_hold_the_texts_and_the_cli_prints_them(
        tiny_models, tmp_path, capsys):
    """A run with the real task (the tiny models' tokenizer and judge template)."""
    from pivotrl_hpc.cli.main import main
    from pivotrl_hpc.sim.run import SimConstants, simulate

    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml",
                      [*model_overrides(tiny_models), "rl.steps=3", "rl.eval_every=2",
                       "rl.eval_prompts=4", "trace.samples=3"])
    path = tmp_path / "sim.h5"
    simulate(cfg, SimConstants.from_config(cfg), path)
    rows = _table(path, "samples")
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 9 and len([r for r in rows if r["kind"] == "eval"]) == 6
    for r in train:
        assert "Answer:" in r["prompt"] or "answer" in r["prompt"].lower()   # DAPO's prompt
        assert isinstance(r["response"], str) and isinstance(r["judgement"], str)
        assert r["data_source"] == "math_dapo"
        assert r["parse"] in ("parsed", "unparsed", "truncated")
    assert all(r.ok for r in check(path))
    assert main(["trace", "samples", str(path)]) == 0
    out = capsys.readouterr()
    assert out.out.count("== step ") == 9 and out.out.count("== evaluation after") == 6
    assert "judgement (" in out.out and "response (" in out.out
    assert "15 of 15 kept samples" in out.err
    assert main(["trace", "samples", str(path), "--step", "1", "--kind", "train"]) == 0
    assert capsys.readouterr().out.count("== step 1 train") == 3
    assert main(["trace", "samples", str(path), "--unparsed"]) == 0
    unparsed = sum(r["parse"] in ("unparsed", "truncated") for r in rows)
    assert capsys.readouterr().out.count("== ") == unparsed
    assert main(["trace", "samples", str(tmp_path / "absent.h5")]) == 2


def test_a_validation_file_is_checked_whenever_set_and_unused_warns(tiny_models, tmp_path,
                                                                    caplog):
    base = [*model_overrides(tiny_models)]
    bad = tmp_path / "val.jsonl"   # rows without reward_model
    bad.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1?"}],
                               "data_source": "x"}) + "\n")
    from pivotrl_hpc.launch.preflight import load_checked   # what `pivotrl run` loads with

    for extra in (["rl.eval_every=0"], ["rl.eval_every=2"]):
        with pytest.raises(ConfigError, match="data.validation"):
            load_checked(ROOT / "configs" / "tiny-cpu.yaml",
                         [*base, f"data.validation={bad}", *extra])
    with caplog.at_level(logging.WARNING, logger="pivotrl_hpc.task.task"):
        load_checked(ROOT / "configs" / "tiny-cpu.yaml", [*base, "rl.steps=2"])
    assert "is set but never evaluated" in caplog.text and "rl.eval_every" in caplog.text


def test_trace_settings_are_checked(tiny_models):
    base = [*model_overrides(tiny_models)]
    for bad, words in ((["trace.samples=some"], "all, none"),
                       (["trace.samples=-1"], ">= 0"),
                       (["trace.loggers=[console, mlflow]"], "trace.loggers\\[1\\]")):
        with pytest.raises(ConfigError, match=words):
            load_config(ROOT / "configs" / "tiny-cpu.yaml", [*base, *bad], check_files=False)
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml",
                      [*base, "trace.samples=all", "trace.loggers=[console,tensorboard]"],
                      check_files=False)
    assert cfg.trace.samples == "all" and cfg.trace.loggers == ["console", "tensorboard"]


def test_wandb_offline_logs_step_metrics_under_verl_names_and_a_samples_table(
        tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from pivotrl_hpc.trace.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(tmp_path / "run.h5", {"config": {"rl": {"eval_samples": 1}}})
    path, summary = _modeled(tmp_path, loggers=(logger,))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    names = ("training/global_step", "critic/score/mean", "actor/pg_loss", "timing_s/step",
             "pivotrl/genrm_mean", "pivotrl/unparsed", "val-core/aime/acc/mean@1",
             "val-core/all/acc/mean@1")
    for _ in range(120):   # wandb's service process may still be writing the run file
        data = next(runs[0].glob("run-*.wandb")).read_bytes()
        if all(n.encode() in data for n in names):
            break
        time.sleep(0.5)
    for name in names:
        assert name.encode() in data, name
    table = json.loads(next(runs[0].rglob("samples_*.table.json")).read_text())
    assert table["columns"][:4] == ["step", "kind", "data_source", "prompt"]
    assert len(table["data"]) == len(_table(path, "samples")) == 3 * 4 + 2 * 4
    assert os.environ["WANDB_MODE"] == "offline"
