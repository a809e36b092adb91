"""The project's synthetic math set, generated from a seed, written in the formats real RL data
comes in.

`write_dataset` writes a training set in the veRL/DAPO-Math-17k schema and a validation set in
the schema of DAPO's AIME-2024 parquet (both: `data_source`, `prompt` = a list of chat
messages, `ability`, `reward_model` = {`ground_truth`, `style`}, `extra_info`), so a CPU run
reads the same columns as a job on DAPO-Math-17k and AIME24 (`pivotrl_hpc.task.data`). The
user message asks for the answer after "Answer:" (a short form of DAPO's instruction), which
the DAPO reward (`task.rewards`) checks.
"""
from __future__ import annotations

import random
from pathlib import Path

OPS = ("+", "-", "*")
# DAPO-Math-17k's prompt around each problem (its `prompt[0].content`).
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response "
               "should be of the form Answer: $Answer (without quotes) where $Answer is the "
               "answer to the problem.\n\n")
DAPO_SUFFIX = "\n\nRemember to put your answer on its own line after \"Answer:\"."
# The tiny set's shorter instruction of the same rule: prompts of ~25 tokens keep the CPU
# runs' prefill (and the simulator's tests of them) at the size they were tuned for.
TINY_SUFFIX = " Give the answer after \"Answer:\"."


def make_problem(rng: random.Random, idx: int) -> dict:
    op = rng.choice(OPS)
    a, b = rng.randint(0, 99), rng.randint(0, 99 if op != "*" else 12)
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"id": idx, "problem": f"What is {a} {op} {b}?", "answer": str(answer)}


def make_split(seed: int, n: int, start: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [make_problem(rng, start + i) for i in range(n)]


# How a problem is asked: the tiny set's short rule, or DAPO-Math-17k's own instruction
# (prompts of ~80 tokens, as a real DAPO batch has).
INSTRUCTIONS = {"tiny": ("", TINY_SUFFIX), "dapo": (DAPO_PREFIX, DAPO_SUFFIX)}


def dapo_row(rec: dict, source: str, instruction: str = "tiny") -> dict:
    """One row of the veRL/DAPO schema for a synthetic record."""
    prefix, suffix = INSTRUCTIONS[instruction]
    return {"data_source": source,
            "prompt": [{"role": "user", "content": prefix + rec["problem"] + suffix}],
            "ability": "MATH",
            "reward_model": {"ground_truth": rec["answer"], "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": str(rec["id"]), "raw_problem": rec["problem"]}}


SPLITS = {"train": ("train.parquet", "math_dapo"), "validation": ("aime-style.parquet", "aime24")}


def write_dataset(out: Path, seed: int = 0, train: int = 512, validation: int = 64,
                  instruction: str = "tiny") -> dict:
    """Write the DAPO-schema train set and the AIME-schema validation set (parquet) under
    `out`; return their paths by split. `instruction`: a key of INSTRUCTIONS."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = {}
    for split, n, s, start in (("train", train, seed, 0),
                               ("validation", validation, seed + 10_007, train)):
        name, source = SPLITS[split]
        rows = [dapo_row(rec, source, instruction) for rec in make_split(s, n, start)]
        path = out / name
        pq.write_table(pa.Table.from_pylist(rows), path)
        paths[split] = path
    return paths
