"""Synthetic arithmetic problems with verifiable answers, generated from a seed.

Each record is {"id", "problem", "answer"}; the text uses only tokens of the local tokenizer,
so prompts encode without <unk>.
"""
from __future__ import annotations

import json
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


def read_jsonl(path: Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def prompt_text(problem: str) -> str:
    return f"problem : {problem} solution :"


def extract_answer(text: str) -> str | None:
    """The last integer in the decoded text (tokens may be space-separated digits)."""
    import re

    compact = re.sub(r"(?<=\d) (?=\d)", "", text)
    compact = re.sub(r"- (?=\d)", "-", compact)
    found = re.findall(r"-?\d+", compact)
    return found[-1] if found else None
