"""An example verifiable reward for `reward.verifiable: examples/my_reward.py:compute_score`
(README "A user's own job"). veRL's signature: called once per response with the prompt row's
`data_source`, the decoded response, `reward_model.ground_truth` and `extra_info`; return a
number or a dict with "score" (and "acc", which validation accuracy counts). The job calls it
once on a dry sample before any device starts, so an import error or a wrong signature stops
it at once."""
from __future__ import annotations

import re


def _boxed(text: str) -> str | None:
    found = re.findall(r"\\boxed\{([^{}]*)\}", text)
    return found[-1].strip() if found else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """+1 when the last \\boxed{} (or, failing that, the last "Answer:" line) equals the
    ground truth, -1 otherwise; a response with no answer at all gets -1.5."""
    answer = _boxed(solution_str)
    if answer is None:
        lines = re.findall(r"(?i)answer\s*:\s*([^\n]+)", solution_str)
        answer = lines[-1].strip() if lines else None
    if answer is None:
        return {"score": -1.5, "acc": False}
    acc = answer.replace(" ", "") == str(ground_truth).replace(" ", "")
    return {"score": 1.0 if acc else -1.0, "acc": acc}
