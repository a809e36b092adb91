"""The task built from a config (pivotrl_hpc.task.task) on the tiny models: chat-templated
prompts, overlong prompts filtered or rejected, judge prompts that fit, and every bad input
stopped by `load_checked` (load_config and the launch's preflight: what `pivotrl run` and
`pivotrl config` call before any device starts) with the key to fix."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from live_util import ROOT, model_overrides

from pivotrl_hpc.config import ConfigError, load_config
from pivotrl_hpc.launch.preflight import load_checked
from pivotrl_hpc.task.task import build_task

CONFIG = ROOT / "configs" / "tiny-cpu.yaml"


@pytest.fixture(scope="module")
def built(tiny_models):
    cfg = load_config(CONFIG, [*model_overrides(tiny_models), "rl.eval_every=1"])
    return (cfg, *build_task(cfg))


def error(tiny_models, overrides) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load_checked(CONFIG, [*model_overrides(tiny_models), *overrides])
    return e.value


def test_prompts_are_the_policy_chat_template_of_the_dapo_rows(built):
    cfg, task, train, validation = built
    rec = task.records[train[0].pid]
    text = task.policy.tok.decode(list(train[0].prompt_ids))
    assert text == f"<|im_start|>user\n{rec.problem}<|im_end|>\n<|im_start|>assistant\n"
    assert len(train) == cfg.rl.steps * cfg.rl.batch_size
    assert [p.pid for p in train] != sorted(p.pid for p in train)   # shuffled by the seed
    assert len(validation) == cfg.rl.eval_prompts and all(p.pid < 0 for p in validation)
    assert task.records[validation[0].pid].data_source == "aime24"


def test_r_dapo_and_the_judge_prompt_of_a_long_response(built):
    cfg, task, train, _ = built
    p = train[0]
    right = task.policy.encode(f"It is {p.answer}.\nAnswer: {p.answer}")
    assert task.score(p, right, []).verifiable == 1.0
    assert task.score(p, task.policy.encode("Answer: x"), []).verifiable == -1.0
    assert task.correct(p, right) and not task.correct(p, [])
    long = task.policy.encode("blah " * 200 + f"Answer: {p.answer}")
    ids = task.judge_prompt(p, long)
    assert len(ids) <= cfg.models.genrm.max_prompt_len
    judge_text = task.genrm.tok.decode(ids)
    assert f"Answer: {p.answer}" in judge_text and "Verdict (yes or no)?" in judge_text
    rng = random.Random(0)   # random tokens re-encode up to 3x longer: still cut to fit
    for _ in range(200):
        response = [rng.randrange(512) for _ in range(rng.randrange(1, 64))]
        assert len(task.judge_prompt(p, response)) <= cfg.models.genrm.max_prompt_len
    empty = task.score(p, right, [])
    assert (empty.genrm, empty.parsed) == (0.0, False)   # no judgement: the default, counted


def test_overlong_prompts_are_filtered_and_counted_or_rejected(tiny_models, caplog):
    cfg = load_config(CONFIG, [*model_overrides(tiny_models), "models.policy.max_prompt_len=24"])
    task, train, _ = build_task(cfg)
    kept = [pid for pid in task.records if pid >= 0]
    assert 0 < task.filtered["train"] < 64 and len(kept) == 64 - task.filtered["train"]
    assert {p.pid for p in train} <= set(kept)
    assert "longer than models.policy.max_prompt_len=24 or models.genrm.max_prompt_len=96 " \
        "tokens and were left out" in caplog.text
    e = error(tiny_models, ["models.genrm.max_prompt_len=50", "data.overlong=reject"])
    assert e.key == "data.train" and "before any response, over models.genrm.max_prompt_len" \
        in str(e)
    e = error(tiny_models, ["models.policy.max_prompt_len=24", "data.overlong=reject"])
    assert e.key == "data.train" and "the rendered prompt has 25 tokens, over " \
        "models.policy.max_prompt_len=24" in str(e)


def test_a_missing_column_and_a_wrong_key_path(tiny_models, tmp_path):
    table = pq.read_table(tiny_models / "data" / "train.parquet").drop_columns(["reward_model"])
    pq.write_table(table, tmp_path / "t.parquet")
    e = error(tiny_models, [f"data.train={tmp_path / 't.parquet'}"])
    assert e.key == "data.train" and "t.parquet: no column 'reward_model'" in str(e)
    e = error(tiny_models, ["data.answer_key=reward_model.truth"])
    assert e.key == "data.train" and "row 0: key 'reward_model.truth': no 'truth'" in str(e)


def test_a_wrong_type_in_a_row_names_file_row_and_key(tiny_models, tmp_path):
    rows = pq.read_table(tiny_models / "data" / "train.parquet").to_pylist()
    rows[5]["reward_model"] = {"ground_truth": None, "style": "x"}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    e = error(tiny_models, [f"data.train={tmp_path / 't.parquet'}"])
    assert "t.parquet: row 5: key 'reward_model.ground_truth' is NoneType, not a string" \
        in str(e)


def test_a_bad_compute_score_stops_before_the_job(tiny_models, tmp_path):
    e = error(tiny_models, ["reward.verifiable=no_such_module:compute_score"])
    assert e.key == "reward.verifiable" and "ModuleNotFoundError" in str(e)
    f = tmp_path / "r.py"
    f.write_text("def compute_score(solution_str):\n    return 1.0\n")
    e = error(tiny_models, [f"reward.verifiable={f}:compute_score"])
    assert e.key == "reward.verifiable" and "cannot take compute_score(" in str(e)


def test_a_model_folder_without_a_chat_template(tiny_models, tmp_path):
    bare = tmp_path / "policy"
    shutil.copytree(tiny_models / "policy", bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    conf = json.loads((bare / "tokenizer_config.json").read_text())
    conf.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(conf))
    e = error(tiny_models, [f"models.policy.path={bare}"])
    assert e.key == "models.policy.path" and "has no chat template" in str(e) and \
        "data.chat_template: none" in str(e)
    cfg = load_config(CONFIG, [*model_overrides(tiny_models), f"models.policy.path={bare}",
                               "data.chat_template=none"])
    task, train, _ = build_task(cfg)
    assert task.policy.tok.decode(list(train[0].prompt_ids)) == \
        task.records[train[0].pid].problem


def test_judge_settings_are_checked(tiny_models, tmp_path):
    assert error(tiny_models, ["reward.genrm_parse=regex"]).key == "reward.genrm_regex"
    assert error(tiny_models, ["reward.genrm_default=2"]).key == "reward.genrm_default"
    e = error(tiny_models, [f"reward.genrm_template={tmp_path / 'absent.txt'}"])
    assert e.key == "reward.genrm_template" and "does not exist" in str(e)
    e = error(tiny_models, ["models.genrm.max_prompt_len=30"])
    assert e.key == "models.genrm.max_prompt_len" and "alone renders to" in str(e)


def test_the_readme_job_is_a_valid_config_and_its_reward_file_loads(tmp_path):
    """The README's "A user's own job" block uses only keys the schema has; its example
    compute_score loads and scores by veRL's signature."""
    import re

    from pivotrl_hpc.task.rewards import load_scorer

    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## A user's own job.*?```yaml\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "job.yaml").write_text(block)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    cfg = load_config(tmp_path / "job.yaml", check_files=False)
    where, name = cfg.reward.verifiable.rsplit(":", 1)
    assert name == "compute_score" and \
        Path(where).samefile(ROOT / "examples" / "my_reward.py")   # relative to the config
    scorer = load_scorer(cfg.reward.verifiable, ("math_dapo", "Answer: 0", "42", {}))
    assert scorer("math_dapo", "so \\boxed{42}", "42", {}).score == 1.0
    assert scorer("math_dapo", "Answer: 41", "42", {}).score == -1.0
    assert scorer("math_dapo", "no idea", "42", {}).score == -1.5
