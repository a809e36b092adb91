"""Generative reward model (GenRM) prompts and score parsing (paper §8.1: R = R_DAPO + R_GenRM).

The GenRM reads a judge prompt built from (problem, response) and generates a short verdict.
The reward role runs it on a `VLLMEngine` like any other sequence (so it can be aborted and
migrated); this module only turns text into token ids and generated ids into a score.

Score mapping (deterministic, also meaningful for the random-weight CPU GenRM): scan the
generated tokens in order; the first *verdict token* decides —
  "yes" or "correct"  -> 1.0
  "no" or "wrong"     -> 0.0
  a digit d (0-9)     -> d / 9   (a graded verdict)
If no verdict token appears (or the GenRM stopped at once), the score is 0.0: an undecided
judge gives no reward. Tokens after the first verdict are ignored, so the score does not
depend on how long the judge rambles on.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pivotrl_hpc.assets.tokenizer import BOS_ID

log = logging.getLogger(__name__)

JUDGE_TEMPLATE = ("problem : {problem} solution : {response} "
                  "judge : is the solution correct ? verdict :")
POSITIVE = ("yes", "correct")
NEGATIVE = ("no", "wrong")
DEFAULT_VERDICT_TOKENS = 8


@dataclass(frozen=True)
class GenRMScore:
    score: float                  # in [0, 1]
    verdict: str | None           # the token that decided, None when undecided
    verdict_position: int | None  # its index among the generated tokens


class JudgePrompter:
    """Builds judge prompts and parses verdicts with the GenRM folder's local tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self._verdict_of: dict[int, tuple[str, float]] = {}
        for word in POSITIVE:
            self._verdict_of[vocab[word]] = (word, 1.0)
        for word in NEGATIVE:
            self._verdict_of[vocab[word]] = (word, 0.0)
        for d in range(10):
            self._verdict_of[vocab[str(d)]] = (str(d), d / 9.0)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> JudgePrompter:
        from transformers import PreTrainedTokenizerFast

        return cls(PreTrainedTokenizerFast.from_pretrained(str(model_dir)))

    def prompt_ids(self, problem: str, response: str) -> list[int]:
        """<s> + the judge template; unknown words become <unk> (the text is the policy's)."""
        text = JUDGE_TEMPLATE.format(problem=problem.strip(), response=response.strip())
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return [BOS_ID] + list(ids)

    def response_text(self, token_ids: Sequence[int]) -> str:
        """Decode a policy response so that it can be placed in the judge prompt."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def parse(self, generated_ids: Sequence[int]) -> GenRMScore:
        """Score per the module's mapping: the first verdict token decides."""
        for pos, tok in enumerate(generated_ids):
            hit = self._verdict_of.get(int(tok))
            if hit is not None:
                return GenRMScore(hit[1], hit[0], pos)
        return GenRMScore(0.0, None, None)


def total_reward(verifiable: float, genrm: GenRMScore) -> float:
    """R = R_verifiable + R_GenRM (paper §8.1)."""
    return float(verifiable) + genrm.score


def judge(engine, prompter: JudgePrompter, items: Sequence[tuple[str, str]],
          max_new_tokens: int = DEFAULT_VERDICT_TOKENS, prefix: str = "judge"
          ) -> list[GenRMScore]:
    """Score (problem, response) pairs on a GenRM engine with greedy decoding, one batch.

    For callers without a reward scheduler (tools, tests); the reward role dispatches the
    same prompts through the scheduler instead, so that they can migrate between replicas.
    """
    from pivotrl_hpc.engines.vllm.types import Sampling

    if engine.num_running:
        # run_to_completion would also finish (and here drop) the other sequences.
        raise RuntimeError(f"judge needs an idle engine; {engine.num_running} running")
    greedy = Sampling(temperature=0.0)
    ids = [f"{prefix}-{i}" for i in range(len(items))]
    for seq_id, (problem, response) in zip(ids, items):
        engine.add(seq_id, prompter.prompt_ids(problem, response), [], max_new_tokens, greedy)
    done = engine.run_to_completion()
    scores = [prompter.parse(done[s].token_ids) for s in ids]
    log.debug("judged %d responses, mean score %.3f", len(scores),
              sum(s.score for s in scores) / max(1, len(scores)))
    return scores
