"""RL prompts from parquet (the veRL/DAPO schema), JSONL with the same keys, or the project's
synthetic set; every row checked before any worker starts.

A row becomes a `Record`: its chat messages (the `data.prompt_key` column: a list of
{role, content} messages, or a plain string taken as one user message), its ground truth (the
`data.answer_key` dotted path, e.g. `reward_model.ground_truth`), `data_source` and
`extra_info` (veRL's `compute_score` arguments). A missing column, a missing key on the path
or a value of the wrong type raises DatasetError naming the file, the row and the key (or,
with `data.on_bad_line: skip`, drops the row and logs how many were dropped).
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FORMATS = ("auto", "parquet", "jsonl", "synthetic")


class DatasetError(ValueError):
    """A dataset that cannot be used as configured: names the file, the row and the key."""


@dataclass(frozen=True)
class Record:
    row: int                                  # parquet row / JSONL line (the prompt's id)
    messages: tuple[tuple[str, str], ...]     # (role, content), in order
    answer: str                               # the ground truth
    data_source: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def problem(self) -> str:
        """The last user message: what the GenRM's {problem} shows."""
        users = [c for r, c in self.messages if r == "user"]
        return users[-1] if users else self.messages[-1][1]

    def chat(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


@dataclass(frozen=True)
class DataKeys:
    prompt_key: str = "prompt"
    answer_key: str = "reward_model.ground_truth"
    on_bad_line: str = "error"


def format_of(path: str | Path, fmt: str = "auto") -> str:
    if fmt != "auto":
        return fmt
    suffix = Path(path).suffix.lower()
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    raise DatasetError(f"{path}: cannot tell the format from '{suffix}'; set data.format to "
                       "parquet or jsonl")


def read_records(path: str | Path, fmt: str, keys: DataKeys) -> list[Record]:
    """Every usable row of a parquet or JSONL file, in file order."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path} does not exist")
    fmt = format_of(path, fmt)
    rows = _parquet_rows(path, keys) if fmt == "parquet" else _jsonl_rows(path)
    unit = "row" if fmt == "parquet" else "line"   # parquet rows from 0, JSONL lines from 1
    records, bad = [], []
    for n, row in rows:
        try:
            records.append(to_record(n, row, keys))
        except DatasetError as e:
            if keys.on_bad_line != "skip":
                raise DatasetError(f"{path}: {unit} {n}: {e} (data.on_bad_line=skip skips "
                                   "such rows)") from None
            bad.append(n)
    if bad:
        log.warning("%s: skipped %d malformed row(s) (first: %s %d)", path, len(bad), unit,
                    bad[0])
    if not records:
        raise DatasetError(f"{path} holds no usable rows")
    return records


def _parquet_rows(path: Path, keys: DataKeys):
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow: ArrowInvalid, OSError, ...
        raise DatasetError(f"{path}: not a readable parquet file ({e})") from None
    for key in (keys.prompt_key, keys.answer_key):
        top = key.split(".")[0]
        if top not in table.column_names:
            raise DatasetError(f"{path}: no column {top!r} (for {_which(key, keys)}={key!r}); "
                               f"its columns: {', '.join(table.column_names)}")
    return enumerate(table.to_pylist())


def _jsonl_rows(path: Path):
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield n, json.loads(line)
                except ValueError as e:
                    yield n, _NotJSON(str(e))


class _NotJSON(str):
    """A JSONL line that did not parse (checked, and named, by `to_record`)."""


def _which(key: str, keys: DataKeys) -> str:
    return "data.prompt_key" if key == keys.prompt_key else "data.answer_key"


def lookup(row: Any, dotted: str) -> Any:
    """`row[a][b]...` for the dotted path "a.b..."; DatasetError naming the missing part."""
    node = row
    for depth, part in enumerate(dotted.split(".")):
        where = ".".join(dotted.split(".")[:depth]) or "the row"
        if not isinstance(node, dict):
            raise DatasetError(f"key {dotted!r}: {where} is {type(node).__name__}, not a mapping")
        if part not in node:
            raise DatasetError(f"key {dotted!r}: no {part!r} in {where} (it has: "
                               f"{', '.join(map(str, node)) or 'nothing'})")
        node = node[part]
    return node


def to_record(n: int, row: Any, keys: DataKeys) -> Record:
    if isinstance(row, _NotJSON):
        raise DatasetError(f"not JSON ({row})")
    if not isinstance(row, dict):
        raise DatasetError(f"a {type(row).__name__}, not an object")
    messages = _messages(lookup(row, keys.prompt_key), keys.prompt_key)
    answer = lookup(row, keys.answer_key)
    if isinstance(answer, bool) or not isinstance(answer, (str, int)):
        raise DatasetError(f"key {keys.answer_key!r} is {type(answer).__name__}, not a string")
    source = row.get("data_source") or ""
    extra = row.get("extra_info") or {}
    if not isinstance(source, str) or not isinstance(extra, dict):
        raise DatasetError("data_source must be a string and extra_info a mapping")
    return Record(n, messages, str(answer), source, extra)


def _messages(value: Any, key: str) -> tuple[tuple[str, str], ...]:
    if isinstance(value, str):
        return (("user", value),)
    if not isinstance(value, (list, tuple)) or not value:
        raise DatasetError(f"key {key!r} is {type(value).__name__}, not a string or a non-empty"
                           " list of chat messages")
    out = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise DatasetError(f"key {key!r}: message {i} is not a {{role, content}} pair of "
                               f"strings ({str(m)[:80]})")
        out.append((m["role"], m["content"]))
    return tuple(out)


def synthetic(split: str, seed: int, n: int) -> list[Record]:
    """The project's synthetic set (`task.synthetic`), in memory: no file."""
    from pivotrl_hpc.task.synthetic import SPLITS, dapo_row, make_split

    start = 0 if split == "train" else 1_000_000
    rows = [dapo_row(r, SPLITS[split][1])
            for r in make_split(seed + (0 if split == "train" else 10_007), n, start)]
    return [to_record(i, row, DataKeys()) for i, row in enumerate(rows)]


def epochs(items: list, seed: int, needed: int) -> list:
    """`needed` items: the list reshuffled once per pass, each pass with its own seed (veRL's
    shuffled sampler), so the order depends only on the run's seed and a data cursor
    (prompts taken so far) names the same prompt on resume."""
    out: list = []
    epoch = 0
    while len(out) < needed:
        order = list(items)
        random.Random(f"{seed}-{epoch}").shuffle(order)
        out += order
        epoch += 1
    return out[:needed]
