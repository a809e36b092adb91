"""The synthetic arithmetic task's shaped reward, as a veRL `compute_score` function
(`reward.verifiable: pivotrl_hpc.task.arithmetic:compute_score`).

1 for the right final number; otherwise partial credit, the fraction of the response's
non-blank characters that are digits ("answer with a number"), so that a tiny random-weight
policy has a signal it can climb within a few steps on CPU. Not the paper's R_DAPO (`dapo`).
"""
from __future__ import annotations

import re
from typing import Any


def last_integer(text: str) -> str | None:
    found = re.findall(r"-?\d+", text)
    return found[-1] if found else None


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: dict | None = None) -> dict[str, Any]:
    if last_integer(solution_str) == str(ground_truth).strip():
        return {"score": 1.0, "acc": True}
    chars = [c for c in solution_str if not c.isspace()]
    return {"score": sum(c.isdigit() for c in chars) / max(1, len(chars)), "acc": False}
