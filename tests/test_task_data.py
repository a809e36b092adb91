"""RL data (pivotrl_hpc.task.data): veRL/DAPO-schema parquet, JSONL with the same keys, the
synthetic set; every bad row named by file, row and key; the order fixed by the seed."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pivotrl_hpc.task.synthetic import TINY_SUFFIX, dapo_row, make_split, write_dataset
from pivotrl_hpc.task.data import DataKeys, DatasetError, epochs, read_records, synthetic

ROWS = [dapo_row(r, "math_dapo") for r in make_split(0, 6)]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_parquet_in_the_verl_schema_reads_messages_and_the_dotted_answer(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", ROWS)
    recs = read_records(path, "auto", DataKeys())
    assert [r.row for r in recs] == list(range(6))
    assert recs[0].answer == ROWS[0]["reward_model"]["ground_truth"]
    assert recs[0].messages == (("user", ROWS[0]["prompt"][0]["content"]),)
    assert recs[0].problem.endswith(TINY_SUFFIX) and recs[0].data_source == "math_dapo"
    assert recs[0].extra_info["raw_problem"] == make_split(0, 1)[0]["problem"]


def test_jsonl_with_the_same_keys_reads_the_same_records(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    parquet = read_records(write_parquet(tmp_path / "d.parquet", ROWS), "auto", DataKeys())
    jsonl = read_records(path, "auto", DataKeys())
    assert [(r.messages, r.answer) for r in jsonl] == [(r.messages, r.answer) for r in parquet]


def test_other_keys_and_a_plain_string_prompt(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "What is 2 + 2?", "meta": {"gold": 4}}\n')
    (rec,) = read_records(path, "jsonl", DataKeys("question", "meta.gold"))
    assert rec.messages == (("user", "What is 2 + 2?"),) and rec.answer == "4"


def test_a_missing_column_names_file_and_key(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "reward_model"} for r in ROWS]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DatasetError, match=r"bad.parquet: no column 'reward_model' \(for "
                                           r"data.answer_key='reward_model.ground_truth'\)"):
        read_records(path, "auto", DataKeys())


def test_a_wrong_key_path_names_file_row_and_the_missing_part(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", ROWS)
    with pytest.raises(DatasetError, match=r"d.parquet: row 0: key 'reward_model.answer': no "
                                           r"'answer' in reward_model \(it has: ground_truth, "
                                           r"style\)"):
        read_records(path, "auto", DataKeys(answer_key="reward_model.answer"))


def test_a_wrong_type_names_the_row_and_skip_drops_it(tmp_path):
    rows = [dict(r) for r in ROWS]
    path = tmp_path / "d.jsonl"
    rows[3] = {**rows[3], "prompt": [{"role": "user", "content": 7}]}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError, match=r"d.jsonl: line 4: key 'prompt': message 0 is not "
                                           "a {role, content} pair of strings"):
        read_records(path, "auto", DataKeys())
    kept = read_records(path, "auto", DataKeys(on_bad_line="skip"))
    assert [r.row for r in kept] == [1, 2, 3, 5, 6]


def test_not_json_and_no_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("{oops\n")
    with pytest.raises(DatasetError, match=r"d.jsonl: line 1: not JSON"):
        read_records(path, "auto", DataKeys())
    with pytest.raises(DatasetError, match="holds no usable rows"):
        read_records(path, "auto", DataKeys(on_bad_line="skip"))
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DatasetError, match="cannot tell the format from '.csv'"):
        read_records(csv, "auto", DataKeys())


def test_init_models_sets_are_dapo_and_aime_schema_and_match_the_synthetic_set(tmp_path):
    paths = write_dataset(tmp_path, seed=0, train=20, validation=5)
    train = read_records(paths["train"], "auto", DataKeys())
    val = read_records(paths["validation"], "auto", DataKeys())
    assert {r.data_source for r in train} == {"math_dapo"}
    assert {r.data_source for r in val} == {"aime24"}
    assert [r.answer for r in train] == [r.answer for r in synthetic("train", 0, 20)]
    assert set(pq.read_schema(paths["train"]).names) == {
        "data_source", "prompt", "ability", "reward_model", "extra_info"}


def test_epochs_shuffle_by_seed_and_cover_every_prompt_each_pass():
    items = list(range(10))
    a, b = epochs(items, 0, 25), epochs(items, 0, 25)
    assert a == b and a != epochs(items, 1, 25) and a[:10] != items
    assert sorted(a[:10]) == items and sorted(a[10:20]) == items and a[:10] != a[10:20]
    assert len(a) == 25
    # a run resumed with more rl.steps takes the same prompts at the same cursor
    assert epochs(items, 0, 15) == a[:15]
