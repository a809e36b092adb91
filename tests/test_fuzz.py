"""Hostile input, property-based (hypothesis, 500 examples per parser): the config loader
(YAML files, mappings and dotted overrides), the snapshot loader, the dataset reader and the
GenRM verdict parser raise only their documented errors, and never hang."""
from __future__ import annotations

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pivotrl_hpc.config.errors import ConfigError
from pivotrl_hpc.config.load import apply_overrides, build, load_config
from pivotrl_hpc.config.schema import Config
from pivotrl_hpc.plan.snapshot import SnapshotError, WorkloadSnapshot
from pivotrl_hpc.task.data import DataKeys, DatasetError, read_records

EXAMPLES = settings(max_examples=500, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

KEYS = ["cluster", "models", "policy", "genrm", "rl", "steps", "nodes", "path", "resume",
        "paradigm", "name", "trace", "data", "train", "on_bad_line", "checkpoint_every",
        "cpu_share", "dtype", "x"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=True), st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)),
    max_leaves=12)
mappings = st.dictionaries(st.sampled_from(KEYS), values, max_size=5)


@EXAMPLES
@given(data=mappings)
def test_config_mappings_raise_only_config_error(data):
    try:
        cfg = build(Config, data)
    except ConfigError:
        return
    assert isinstance(cfg, Config)


@EXAMPLES
@given(items=st.lists(st.tuples(st.lists(st.sampled_from(KEYS + [""]), min_size=1,
                                         max_size=3), st.text(max_size=16)), max_size=4),
       raw=st.lists(st.text(max_size=20), max_size=2))
def test_config_overrides_raise_only_config_error(items, raw):
    overrides = [".".join(k) + "=" + v for k, v in items] + raw
    try:
        build(Config, apply_overrides({}, overrides))
    except ConfigError:
        pass


@EXAMPLES
@given(text=st.one_of(st.text(max_size=200), st.binary(max_size=120).map(
    lambda b: b.decode("latin-1")), values.map(json.dumps)))
def test_config_files_raise_only_config_error(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    try:
        load_config(path, check_files=False)
    except ConfigError:
        pass


def _snapshot() -> dict:
    from pivotrl_hpc.plan.synthetic import synthetic_snapshot
    return synthetic_snapshot(16, seed=1, seqs_per_rollout=2).to_dict()


def _mutate(data, path, value):
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            yield from _paths(v, prefix + (i,))


SNAP = _snapshot()
SNAP_PATHS = [p for p in _paths(SNAP) if p]


@EXAMPLES
@given(edits=st.lists(st.tuples(st.sampled_from(SNAP_PATHS), values), min_size=1, max_size=3),
       drop=st.lists(st.sampled_from(SNAP_PATHS), max_size=1))
def test_snapshot_loader_raises_only_snapshot_error(edits, drop):
    data = json.loads(json.dumps(SNAP))
    for path, value in edits:
        try:
            _mutate(data, path, value)
        except (KeyError, IndexError, TypeError):
            pass   # an earlier edit replaced a parent
    for path in drop:
        try:
            node = data
            for key in path[:-1]:
                node = node[key]
            del node[path[-1]]
        except (KeyError, IndexError, TypeError):
            pass
    try:
        WorkloadSnapshot.from_dict(data)
    except SnapshotError:
        pass


record = st.fixed_dictionaries({"id": st.integers(0, 50), "problem": st.text(max_size=10),
                                "answer": st.text(string.digits, max_size=3)})
line = st.one_of(record.map(json.dumps), values.map(json.dumps), st.text(max_size=30),
                 record.map(lambda r: json.dumps(r)[:-1]),        # truncated
                 record.map(lambda r: json.dumps({**r, "id": str(r["id"])})))


@EXAMPLES
@given(lines=st.lists(line, max_size=8), skip=st.booleans())
def test_dataset_reader_names_file_and_line_or_skips(tmp_path, lines, skip):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    keys = DataKeys("problem", "answer", "skip" if skip else "error")
    try:
        recs = read_records(path, "jsonl", keys)
    except DatasetError as e:
        if str(e) == f"{path} holds no usable rows":
            return
        assert not skip and str(e).startswith(f"{path}: line ")
        n = int(str(e).split(": line ")[1].split(":")[0])
        assert 1 <= n <= len(lines)
        return
    assert all(isinstance(r.answer, str) and r.messages[0][0] == "user" for r in recs)


def test_dataset_reader_error_says_what_is_wrong(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": 1, "problem": "1+1", "answer": "2"}\n\n{"id": 2, "problem": 3}\n')
    keys = DataKeys("problem", "answer")
    with pytest.raises(DatasetError, match=r"d.jsonl: line 3: key 'problem' is int, not a "
                                           "string or a non-empty list of chat messages"):
        read_records(path, "jsonl", keys)
    assert [r.row for r in read_records(path, "jsonl", DataKeys("problem", "answer", "skip"))
            ] == [1]


@pytest.fixture(scope="module")
def genrm_tokenizer(tiny_models):
    from pivotrl_hpc.task.prompts import ChatRenderer
    return ChatRenderer(tiny_models / "genrm")


@EXAMPLES
@given(ids=st.lists(st.integers(-2**40, 2**40), max_size=40),
       family=st.sampled_from(("glm-z1", "qwen3", "qwen3.5", "tiny")))
def test_genrm_parser_scores_any_tokens(genrm_tokenizer, ids, family):
    from pivotrl_hpc.task.judge import FAMILIES, parse_judgement

    got = parse_judgement(genrm_tokenizer.decode(ids), FAMILIES[family].rule)
    assert 0.0 <= got.score <= 1.0
    assert got.parsed or got.score == 0.0
