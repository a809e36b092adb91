"""What the RL loop and the task exchange: a prompt's token ids with its text and ground
truth, and a sample's score. Pure values (the checkpoint stores them as JSON)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptData:
    pid: int                     # the row of the dataset (a validation row: -1 - row)
    prompt_ids: tuple[int, ...]  # rendered by the policy's chat template
    problem: str                 # what the GenRM's {problem} shows
    answer: str                  # the ground truth
    data_source: str = ""        # the row's data_source (accuracy per source, samples)


@dataclass(frozen=True)
class Score:
    verifiable: float   # R_verifiable: the configured compute_score (DAPO: +1 / -1)
    genrm: float        # R_GenRM: the parsed judgement in [0, 1] (reward.genrm_default if none)
    parsed: bool        # False: the judgement had no score (counted)
    w_verifiable: float = 1.0   # reward.weights
    w_genrm: float = 1.0

    @property
    def reward(self) -> float:
        """R = R_verifiable + R_GenRM (§8.1), each times its reward.weights (default 1)."""
        return self.w_verifiable * self.verifiable + self.w_genrm * self.genrm
