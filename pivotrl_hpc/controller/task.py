"""The live task: the arithmetic dataset, the policy's and the GenRM's local tokenizers,
the judge template, and the verifiable reward.

Verifiable reward: 1 for the right answer; otherwise partial credit, the fraction of the
response's tokens that are digits ("answer with a number"), so that a tiny random-weight
policy has a signal it can learn within a few steps on CPU. The GenRM's score comes from
its generated verdict (`engines.vllm.genrm`); no verdict = score 0, counted as unparsed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from pivotrl_hpc.assets.dataset import DatasetError, extract_answer, prompt_text, read_jsonl
from pivotrl_hpc.assets.tokenizer import BOS_ID
from pivotrl_hpc.controller.rl import PromptData, Score


class ArithmeticTask:
    def __init__(self, policy_dir: str, genrm_dir: str, max_prompt_len: int,
                 max_judge_prompt_len: int) -> None:
        from transformers import PreTrainedTokenizerFast

        from pivotrl_hpc.engines.vllm.genrm import JudgePrompter

        self.tok = PreTrainedTokenizerFast.from_pretrained(policy_dir)
        self.judge = JudgePrompter.from_model_dir(genrm_dir)
        self.max_prompt_len, self.max_judge = max_prompt_len, max_judge_prompt_len
        self._digits = {self.tok.convert_tokens_to_ids(str(d)) for d in range(10)}

    def load(self, path: str | Path, limit: int | None = None,
             on_bad_line: str = "error") -> list[PromptData]:
        out = []
        for rec in read_jsonl(Path(path), on_bad_line)[:limit]:
            ids = [BOS_ID] + self.tok.encode(prompt_text(rec["problem"]),
                                             add_special_tokens=False)
            if len(ids) > self.max_prompt_len:
                raise DatasetError(f"{path}: prompt {rec['id']} has {len(ids)} tokens, over "
                                 f"models.policy.max_prompt_len={self.max_prompt_len}")
            out.append(PromptData(int(rec["id"]), tuple(ids), rec["problem"], rec["answer"]))
        if not out:
            raise DatasetError(f"{path} holds no prompts")
        return out

    def text(self, response_ids: Sequence[int]) -> str:
        return self.tok.decode(list(response_ids), skip_special_tokens=True)

    def judge_prompt(self, prompt: PromptData, response_ids: Sequence[int]) -> list[int]:
        ids = self.judge.prompt_ids(prompt.problem, self.text(response_ids))
        if len(ids) > self.max_judge:  # keep the template's tail: it asks for the verdict
            ids = ids[:1] + ids[len(ids) - self.max_judge + 1:]
        return ids

    def correct(self, prompt: PromptData, response_ids: Sequence[int]) -> bool:
        return extract_answer(self.text(response_ids)) == prompt.answer

    def score(self, prompt: PromptData, response_ids: Sequence[int],
              judge_ids: Sequence[int]) -> Score:
        if self.correct(prompt, response_ids):
            verifiable = 1.0
        else:
            verifiable = sum(t in self._digits for t in response_ids) / max(1, len(response_ids))
        g = self.judge.parse(judge_ids)
        return Score(verifiable, g.score, g.verdict is not None)
