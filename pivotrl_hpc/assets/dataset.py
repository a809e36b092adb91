"""Synthetic arithmetic problems with verifiable answers, generated from a seed.

Each record is {"id", "problem", "answer"}; the text uses only tokens of the local tokenizer,
so prompts encode without <unk>.
"""
from __future__ import annotations

import json
import logging
import random
from pathlib import Path

OPS = ("+", "-", "*")


def make_problem(rng: random.Random, idx: int) -> dict:
    op = rng.choice(OPS)
    a, b = rng.randint(0, 99), rng.randint(0, 99 if op != "*" else 12)
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"id": idx, "problem": f"what is {a} {op} {b} ?", "answer": str(answer)}


def make_split(seed: int, n: int, start: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [make_problem(rng, start + i) for i in range(n)]


def write_dataset(out: Path, seed: int = 0, train: int = 512, validation: int = 64) -> dict:
    """Write train.jsonl and validation.jsonl under `out`; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n, s, start in (("train", train, seed, 0),
                               ("validation", validation, seed + 10_007, train)):
        path = out / f"{split}.jsonl"
        with path.open("w") as f:
            for rec in make_split(s, n, start):
                f.write(json.dumps(rec) + "\n")
        paths[split] = path
    return paths


class DatasetError(ValueError):
    """A dataset line that is not a record of the task: names the file and the line."""


FIELDS = {"id": int, "problem": str, "answer": str}


def read_jsonl(path: Path, on_bad_line: str = "error") -> list[dict]:
    """The records of a JSONL dataset (blank lines ignored). A malformed line (not JSON, not
    an object, a field missing or of the wrong type, a repeated id) raises DatasetError
    naming file and line, or with `on_bad_line="skip"` is skipped and logged with the count."""
    records, bad, seen = [], [], set()
    with Path(path).open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = _record(line, seen)
            except DatasetError as e:
                if on_bad_line != "skip":
                    raise DatasetError(f"{path}:{n}: {e} (data.on_bad_line=skip skips such "
                                       "lines)") from None
                bad.append(n)
                continue
            seen.add(rec["id"])
            records.append(rec)
    if bad:
        logging.getLogger(__name__).warning("%s: skipped %d malformed line(s) (first: line %d)",
                                            path, len(bad), bad[0])
    return records


def _record(line: str, seen: set) -> dict:
    try:
        rec = json.loads(line)
    except ValueError as e:
        raise DatasetError(f"not JSON ({e})") from None
    if not isinstance(rec, dict):
        raise DatasetError(f"a {type(rec).__name__}, not a JSON object")
    for key, tp in FIELDS.items():
        if key not in rec:
            raise DatasetError(f"no {key!r} field")
        if not isinstance(rec[key], tp) or isinstance(rec[key], bool):
            raise DatasetError(f"{key!r} is {type(rec[key]).__name__}, not {tp.__name__}")
    if rec["id"] in seen:
        raise DatasetError(f"id {rec['id']} repeats an earlier line")
    return rec


def prompt_text(problem: str) -> str:
    return f"problem : {problem} solution :"


def extract_answer(text: str) -> str | None:
    """The last integer in the decoded text (tokens may be space-separated digits)."""
    import re

    compact = re.sub(r"(?<=\d) (?=\d)", "", text)
    compact = re.sub(r"- (?=\d)", "-", compact)
    found = re.findall(r"-?\d+", compact)
    return found[-1] if found else None
