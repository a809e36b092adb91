"""The samples a run keeps for a person to read (`trace.samples`, the trace's `samples`
table, `pivotrl trace samples RUN`): the texts and scores of some or all trained and
evaluated samples, and validation accuracy per data source.

Which ones: `all`, `none`, or the first N of each step (by sample id: one GRPO group's
responses side by side, so a group whose rewards are all equal shows) and of each
evaluation. Texts come from the task (`describe`); a task without texts (a test's token-id
task) shows the token ids.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from pivotrl_hpc.controller.rl import Sample


def kept(setting: int | str, n: int) -> int:
    """How many of `n` samples `trace.samples` keeps."""
    if setting == "all":
        return n
    if setting == "none":
        return 0
    return min(int(setting), n)


def texts(task, s: Sample) -> dict[str, str]:
    describe = getattr(task, "describe", None)
    if describe is not None:
        return describe(s.prompt, s.response, s.judgement)
    parse = "" if s.score is None or not s.judgement else \
        "parsed" if s.score.parsed else "unparsed"
    return {"prompt": str(list(s.prompt.prompt_ids)), "response": str(s.response),
            "judgement": str(s.judgement) if s.judgement else "", "parse": parse}


def sample_row(task, s: Sample, kind: str, step: int, t: float,
               correct: bool | None = None) -> dict[str, Any]:
    """One `samples` row: `kind` train (step: the step that trained it) or eval (step: the
    steps trained before the evaluation)."""
    score = s.score
    return {"t": t, "step": step, "kind": kind, "sample": s.sid,
            "data_source": s.prompt.data_source,
            "version": -1 if s.version is None else s.version, **texts(task, s),
            "verifiable": None if score is None else score.verifiable,
            "genrm": None if score is None else score.genrm,
            "reward": None if score is None else score.reward,
            "correct": None if correct is None else int(correct),
            "prompt_tokens": len(s.prompt.prompt_ids), "response_tokens": len(s.response),
            "judge_tokens": len(s.judgement)}


class EvalTally:
    """One evaluation's counts: samples and correct ones, per data source."""

    def __init__(self, first_sid: int, size: int) -> None:
        self.first_sid, self.pending = first_sid, size
        self.total: Counter[str] = Counter()
        self.correct: Counter[str] = Counter()
        # samples per policy version that generated them (its oldest token's): a rollout
        # replica may reload to a newer policy before it serves an evaluation's samples
        self.versions: Counter[int] = Counter()

    def add(self, source: str, correct: bool, version: int | None = None) -> None:
        self.total[source] += 1
        self.correct[source] += int(correct)
        self.versions[-1 if version is None else version] += 1
        self.pending -= 1

    def accuracy(self) -> float:
        return sum(self.correct.values()) / max(1, sum(self.total.values()))

    def by_source(self) -> dict[str, dict[str, float]]:
        return {src: {"samples": n, "correct": self.correct[src],
                      "accuracy": self.correct[src] / n}
                for src, n in sorted(self.total.items())}
