"""R as the paper trains on it (§8.1: R = R_DAPO + R_GenRM), with `reward.weights`, and the
task's input files found where the command runs (issue 48)."""
from __future__ import annotations


import pytest
from live_util import ROOT, model_overrides

from pivotrl_hpc.config import ConfigError, load_config
from pivotrl_hpc.task.task import build_task

CONFIG = ROOT / "configs" / "tiny-cpu.yaml"


def task_of(tiny_models, *overrides):
    cfg = load_config(CONFIG, [*model_overrides(tiny_models), *overrides])
    task, train, _ = build_task(cfg)
    return task, train[0]


def test_the_reward_is_the_sum_by_default_and_weighted_when_asked(tiny_models):
    task, p = task_of(tiny_models)
    right = task.policy.encode(f"Answer: {p.answer}")
    yes = task.genrm.encode("Verdict: yes")
    s = task.score(p, right, yes)
    assert (s.verifiable, s.genrm, s.reward) == (1.0, 1.0, 2.0)   # was 0.5 x the sum: 1.0
    wrong = task.score(p, task.policy.encode("Answer: x"), task.genrm.encode("Verdict: no"))
    assert wrong.reward == -1.0
    task, p = task_of(tiny_models, "reward.weights.genrm=0.5", "reward.weights.verifiable=2")
    assert task.score(p, right, yes).reward == 2.5


@pytest.mark.parametrize("override,key", [
    ("reward.weights.genrm=-1", "reward.weights.genrm"),
    ("reward.weights.verifiable=.nan", "reward.weights.verifiable"),
    ("reward.weights.verifiable=.inf", "reward.weights.verifiable"),
    ("reward.weights={verifiable: 0, genrm: 0}", "reward.weights"),
    ("reward.weights.kl=1", "reward.weights.kl"),
])
def test_bad_weights_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, [override], check_files=False)
    assert e.value.key == key


def test_input_files_resolve_where_the_command_runs(tiny_models, tmp_path, monkeypatch):
    """README: `verifiable: examples/my_reward.py:compute_score` in a config kept in
    configs/ means the examples/ of the folder the command runs in (it meant
    configs/examples/, which does not exist); the data too. Paths relative to the config's
    folder still resolve when the command's folder has no such file."""
    work, conf = tmp_path / "work", tmp_path / "conf"
    (work / "examples").mkdir(parents=True)
    conf.mkdir()
    (work / "examples" / "my_reward.py").write_text((ROOT / "examples" / "my_reward.py")
                                                    .read_text())
    (work / "train.parquet").write_bytes((tiny_models / "data" / "train.parquet").read_bytes())
    config = conf / "job.yaml"
    config.write_text(CONFIG.read_text())
    monkeypatch.chdir(work)
    base = [f"models.policy.path={tiny_models / 'policy'}",
            f"models.genrm.path={tiny_models / 'genrm'}", "data.validation=",
            "reward.verifiable=examples/my_reward.py:compute_score"]
    cfg = load_config(config, [*base, "data.train=train.parquet"])
    assert cfg.reward.verifiable == f"{work / 'examples' / 'my_reward.py'}:compute_score"
    assert cfg.data.train == str(work / "train.parquet")
    # typed on the command line: where the command runs, and nowhere else
    (conf / "only-here.parquet").write_bytes((work / "train.parquet").read_bytes())
    with pytest.raises(ConfigError) as e:
        load_config(config, [*base, "data.train=only-here.parquet"])
    assert e.value.key == "data.train" and str(work) in str(e.value) and \
        "typed on the command line" in str(e.value)
    # written in the config file: found in its folder when the command's has no such file
    config.write_text(CONFIG.read_text().replace("../.run/models/data/train.parquet",
                                                 "only-here.parquet"))
    cfg = load_config(config, base)
    assert cfg.data.train == str(conf / "only-here.parquet")
    config.write_text(CONFIG.read_text().replace("../.run/models/data/train.parquet",
                                                 "absent.parquet"))
    with pytest.raises(ConfigError) as e:
        load_config(config, base)
    assert e.value.key == "data.train" and str(work) in str(e.value) and str(conf) in str(e.value)
    config.write_text(CONFIG.read_text())
    with pytest.raises(ConfigError) as e:
        load_config(config, [*base, "reward.verifiable=lib/absent.py:compute_score"])
    assert e.value.key == "reward.verifiable" and str(work) in str(e.value)
    # models and the trace typed on the command line: where the command runs too (they were
    # taken from the config file's folder)
    cfg = load_config(config, [*base, "models.policy.path=pol", "trace.path=out/x.h5"],
                      check_files=False)
    assert (cfg.models.policy.path, cfg.trace.path) == (str(work / "pol"),
                                                        str(work / "out" / "x.h5"))
    assert load_config(config, base, check_files=False).trace.path == \
        str(tmp_path / ".run" / "out" / "tiny-cpu.h5")   # ../.run/out of the config file
    # a file only the simulator reads the config of: not needed, no error
    assert load_config(config, [*base, "data.train=absent.parquet"], check_files=False)
